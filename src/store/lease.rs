//! [`LeaseStore`]: what a store adds for long-running operations.
//!
//! The trait's docs say what a store owes.

use std::{future::Future, time::Duration};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method};

use super::{ClaimRequest, Store, StoreError};
use crate::{
    fingerprint::Fingerprint,
    record::{Record, StoredResponse},
    scope::{Scope, TenantId},
    store::OperationId,
};

/// What the layer asks for besides the [`ClaimRequest`] when a long-running
/// operation arrives.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct LeaseRequest {
    /// How long the lease lasts before another request or a recovery worker
    /// may take the operation over.
    pub lease: Duration,
    /// The id a new operation gets (a takeover keeps the operation's id).
    pub operation_id: OperationId,
    /// The request, stored so that a recovery worker can re-drive it.
    pub request: StoredRequest,
}

impl LeaseRequest {
    /// A request for a lease of `lease` on a new operation `operation_id`.
    pub fn new(lease: Duration, operation_id: OperationId, request: StoredRequest) -> Self {
        LeaseRequest {
            lease: lease.min(super::MAX_WAIT),
            operation_id,
            request,
        }
    }
}

/// The validated request of a long-running operation, as stored with its
/// record: what a recovery worker needs to run it again without its client.
///
/// Only the headers the layer keeps (`Content-Type`, and a gRPC message's
/// `grpc-encoding`) are stored; credentials never are. The tenant is part
/// of the record's scope.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoredRequest {
    /// The method.
    pub method: Method,
    /// The path and query.
    pub target: String,
    /// The kept headers, in order.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The body, byte for byte.
    pub body: Bytes,
}

impl StoredRequest {
    /// A stored request.
    pub fn new(
        method: Method,
        target: impl Into<String>,
        headers: Vec<(HeaderName, HeaderValue)>,
        body: Bytes,
    ) -> Self {
        StoredRequest {
            method,
            target: target.into(),
            headers,
            body,
        }
    }

    /// The headers in the encoding [`StoredResponse`] uses for its own.
    pub fn encode_headers(&self) -> Vec<u8> {
        crate::record::encode_headers(&self.headers)
    }

    /// Reads headers written by [`encode_headers`](Self::encode_headers).
    pub fn decode_headers(bytes: &[u8]) -> Option<Vec<(HeaderName, HeaderValue)>> {
        crate::record::decode_headers(bytes)
    }
}

/// The answer to [`LeaseStore::acquire`].
#[derive(Debug)]
#[non_exhaustive]
pub enum Acquired<L> {
    /// This request owns the operation, under a lease it must keep alive
    /// with heartbeats.
    Owned(Owned<L>),
    /// The operation runs under another owner's live lease (or its lease
    /// expired but the request differs: the layer refuses it).
    Running {
        /// The operation's id.
        operation_id: OperationId,
        /// The fingerprint of the request that started it.
        fingerprint: Fingerprint,
    },
    /// The operation completed; here is its record.
    Completed(Record),
    /// The record was held (by a short transaction, a fenced write) for
    /// longer than the request's wait.
    InProgress,
}

/// A lease just acquired, by a new operation or by a takeover.
#[derive(Debug)]
#[non_exhaustive]
pub struct Owned<L> {
    /// The handle the owner's work proves its ownership with.
    pub lease: L,
    /// The operation's id (kept across takeovers).
    pub operation_id: OperationId,
    /// The attempt token: larger than every token before it for this key.
    pub token: i64,
    /// Which attempt of the operation this is: 1 for a new operation, one
    /// more for each takeover (by a duplicate or a recovery worker).
    pub attempt: u32,
    /// The operation existed before this attempt (`attempt > 1`): this is
    /// a takeover.
    pub taken_over: bool,
}

impl<L> Owned<L> {
    /// An acquired lease, for the operation's `attempt` (1 for a new one).
    pub fn new(lease: L, operation_id: OperationId, token: i64, attempt: u32) -> Self {
        Owned {
            lease,
            operation_id,
            token,
            attempt,
            taken_over: attempt > 1,
        }
    }
}

/// An operation as the status resource shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Operation {
    /// Its id.
    pub id: OperationId,
    /// Where it stands.
    pub state: OperationState,
    /// How many attempts it has had (the first run, takeovers, recoveries).
    pub attempts: u32,
}

impl Operation {
    /// An operation after `attempts` attempts.
    pub fn new(id: OperationId, state: OperationState, attempts: u32) -> Self {
        Operation {
            id,
            state,
            attempts,
        }
    }
}

/// Where an operation stands.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum OperationState {
    /// Its work is running, or waiting for its next attempt (a retry with
    /// the same key or a recovery worker).
    Running,
    /// It completed with this response.
    Completed(StoredResponse),
    /// It ended without an answer after its last allowed attempt; this is
    /// the remembered `500 operation_failed` every retry replays.
    Failed(StoredResponse),
}

/// How long a recovery worker waits before the next attempt of an
/// operation whose previous attempt ended without an answer: `first` after
/// the first attempt, doubling with each further attempt, at most `max`.
/// The wait counts from the end of the lease, so an owner that crashed is
/// retried a lease plus the backoff after its last heartbeat.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Backoff {
    /// The wait after the first attempt.
    pub first: Duration,
    /// The longest wait.
    pub max: Duration,
}

impl Backoff {
    /// A backoff starting at `first`, doubling, capped at `max` (at least
    /// `first`; both at most 100 years).
    pub fn new(first: Duration, max: Duration) -> Self {
        let first = first.min(super::MAX_RETENTION);
        Backoff {
            first,
            max: max.min(super::MAX_RETENTION).max(first),
        }
    }

    /// No wait: an expired lease is recovered at once.
    pub const NONE: Backoff = Backoff {
        first: Duration::ZERO,
        max: Duration::ZERO,
    };

    /// The wait after `attempts` attempts ended.
    pub fn after(&self, attempts: u32) -> Duration {
        let doublings = attempts.saturating_sub(1).min(30);
        self.first.saturating_mul(1u32 << doublings).min(self.max)
    }
}

/// An operation a recovery worker took over, with what it needs to run it again.
#[derive(Debug)]
#[non_exhaustive]
pub struct Recovered<L> {
    /// The new lease.
    pub owned: Owned<L>,
    /// The operation's tenant and endpoint.
    pub scope: Scope,
    /// The stored request.
    pub request: StoredRequest,
}

impl<L> Recovered<L> {
    /// A recovered operation.
    pub fn new(owned: Owned<L>, scope: Scope, request: StoredRequest) -> Self {
        Recovered {
            owned,
            scope,
            request,
        }
    }
}

/// A [`Store`] that can also run long-running operations.
///
/// In the long-running mode an operation does not live in one open
/// transaction. Its record is **committed** `in_progress` with a lease
/// (`lease_expires_at`) and an attempt token, the work runs outside any
/// transaction of the claim, and ownership is proven by the token:
///
/// ```text
/// acquire ──(short tx, COMMIT)──▶ in_progress {lease, token T}
///   owner: heartbeat        extends the lease  WHERE token = T   (no row: fenced)
///   owner: fenced tx        locks the row      WHERE token = T, writes, COMMIT
///   owner: finish           stores the answer  WHERE token = T   (no row: fenced)
///   owner: release          expires the lease  WHERE token = T   (the record stays)
///   owner: fail             stores the failure WHERE token = T   (after the last attempt)
///   lease expired: acquire / recover  CAS T → T' > T, attempt + 1, the same operation runs again
/// ```
///
/// A store implementing this trait owes, beyond the [`Store`] guarantees:
///
/// 1. **One owner.** However many [`acquire`](LeaseStore::acquire) and
///    [`recover`](LeaseStore::recover) calls race for a key, at most one gets
///    [`Acquired::Owned`] per token, and a live lease is never taken over.
/// 2. **Tokens only grow.** A new owner of a key gets a token larger than
///    every token handed out for it before, also after the record was
///    removed (a sequence, not a per-record counter).
/// 3. **Fencing.** [`heartbeat`](LeaseStore::heartbeat),
///    [`fenced`](LeaseStore::fenced), [`commit_fenced`](LeaseStore::commit_fenced),
///    [`finish`](LeaseStore::finish), [`fail`](LeaseStore::fail) and
///    [`release`](LeaseStore::release) succeed only while the lease's token is the record's token, and answer
///    [`StoreErrorKind::Fenced`](super::StoreErrorKind::Fenced) otherwise,
///    changing nothing. A fenced transaction holds the record so that no
///    takeover can happen between its check and its commit.
/// 4. **Recovery.** [`recover`](LeaseStore::recover) takes over one
///    operation whose lease expired (and whose backoff has passed),
///    skipping those another worker is taking over right now, and returns
///    the request stored with it.
/// 5. **Identity.** An operation keeps its id, its record and its status
///    from the first attempt to its final answer: a takeover, a recovery and
///    a [`release`](LeaseStore::release) never remove the record nor change
///    the id, and every new attempt is counted ([`Owned::attempt`],
///    [`Operation::attempts`]). Only the end of its retention makes the key
///    a new operation.
///
/// `tower_idempotency::testing::conformance::run_leases` (feature
/// `test-util`) checks these against any store.
///
/// The lease handle is what the owner's handler finds in its request
/// extensions: [`PgLease`](crate::postgres::PgLease) for
/// [`PgStore`](crate::postgres::PgStore), `SqlxLease` for `SqlxStore`
/// (feature `sqlx`), [`MemoryLease`](crate::memory::MemoryLease) for
/// [`MemoryStore`](crate::memory::MemoryStore).
pub trait LeaseStore: Store {
    /// The owner's proof of ownership: the key and the token.
    type Lease: Clone + Send + Sync + 'static;

    /// Arbitrates a long-running operation: a new operation or a takeover of
    /// one whose lease expired (the same request only) commits an
    /// `in_progress` record under a new, larger token and returns the
    /// lease; otherwise says where the operation stands. Waits at most
    /// [`ClaimRequest::wait`] for a record held by someone else.
    fn acquire(
        &self,
        claim: &ClaimRequest,
        lease: &LeaseRequest,
    ) -> impl Future<Output = Result<Acquired<Self::Lease>, StoreError>> + Send;

    /// Extends the lease to `lease` from now. `Fenced` if the token is no
    /// longer the record's.
    fn heartbeat(
        &self,
        lease: &Self::Lease,
        extend: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Opens a fenced transaction: the record is held at the lease's token
    /// until [`commit_fenced`](Self::commit_fenced) or [`Store::abort`], so
    /// no takeover can come between the check and the commit. `Fenced` if
    /// the token is no longer the record's.
    fn fenced(
        &self,
        lease: &Self::Lease,
    ) -> impl Future<Output = Result<Self::Tx, StoreError>> + Send;

    /// Commits a transaction from [`fenced`](Self::fenced).
    fn commit_fenced(&self, tx: Self::Tx) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Completes the operation with `response`, remembered for the claim's
    /// retention, if the lease's token is still the record's (`Fenced`
    /// otherwise): a compare-and-swap.
    fn finish(
        &self,
        lease: &Self::Lease,
        response: &StoredResponse,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Gives the lease up after an attempt that ended without an answer to
    /// remember, if the token is still the record's (`Fenced` otherwise).
    /// The record stays: the lease expires now and the token moves past
    /// this lease's (so this attempt is fenced from here on), and the next
    /// [`acquire`](Self::acquire) of the same request resumes the **same
    /// operation** at once, as [`recover`](Self::recover) does after its
    /// backoff. Whatever the attempt committed or sent stays done.
    fn release(&self, lease: &Self::Lease) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Ends the operation `failed` after its last allowed attempt, if the
    /// token is still the record's (`Fenced` otherwise): `response` (the
    /// layer's `500 operation_failed`) is remembered for the claim's
    /// retention and replayed to every retry, and the status resource shows
    /// the operation failed after `attempts` attempts.
    fn fail(
        &self,
        lease: &Self::Lease,
        response: &StoredResponse,
        attempts: u32,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The operation `id` of `tenant`, if it exists and is unexpired. Another
    /// tenant's operation is `None`, as an unknown id is.
    fn operation(
        &self,
        tenant: &TenantId,
        id: OperationId,
    ) -> impl Future<Output = Result<Option<Operation>, StoreError>> + Send;

    /// Takes over one operation of `endpoint` whose lease expired at least
    /// `backoff.after(attempts)` ago, under a new token and a lease of
    /// `lease`; `None` if there is none (or every one is being taken over by
    /// someone else right now). Its answer, once finished, is remembered for
    /// `retention`.
    fn recover(
        &self,
        endpoint: &str,
        lease: Duration,
        retention: Duration,
        backoff: Backoff,
    ) -> impl Future<Output = Result<Option<Recovered<Self::Lease>>, StoreError>> + Send;
}
