//! Stores: where keys are arbitrated and responses remembered.
//!
//! [`PgStore`](crate::postgres::PgStore) is the production store; [`MemoryStore`](crate::memory::MemoryStore) keeps
//! the same contract in memory for unit tests and as the reference for custom
//! stores. A custom store must provide these guarantees:
//!
//! 1. **One owner.** For one `(scope, key)` at most one [`Claim::Owned`] is
//!    outstanding at a time, and at most one owner ever completes while the
//!    record lives.
//! 2. **Atomic completion.** [`Store::complete`] makes the remembered response
//!    and every write the handler made through the transaction handle durable
//!    together, or none of them.
//! 3. **Abort frees the key.** After [`Store::abort`] (or a failed
//!    `complete`) nothing the owner wrote exists and the next claim owns the key.
//! 4. **Bounded waiting.** A claim that meets an unfinished owner waits at most
//!    [`ClaimRequest::wait`], then answers [`Claim::InProgress`].
//! 5. **Expiry.** A record whose retention has passed is taken over by the next
//!    claim as a new operation.
//!
//! Long-running operations (leases and fencing tokens) add [`LeaseStore`].
//!
//! With the `test-util` feature, `tower_idempotency::testing::conformance`
//! checks these against any store.

use std::{fmt, future::Future, time::Duration};

mod lease;

pub use lease::{
    Acquired, LeaseRequest, LeaseStore, Operation, OperationState, Owned, Recovered, StoredRequest,
};

use crate::{
    fingerprint::Fingerprint,
    key::IdempotencyKey,
    record::{Record, StoredResponse},
    scope::Scope,
};

/// What the layer asks a store for when a request arrives.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{
///     fingerprint::Fingerprint,
///     key::IdempotencyKey,
///     scope::{Scope, TenantId},
///     store::ClaimRequest,
/// };
///
/// let claim = ClaimRequest::new(
///     Scope::new(TenantId::new("tenant-a"), "POST /orders v1"),
///     IdempotencyKey::parse(b"k-1").unwrap(),
///     Fingerprint::from_bytes([0; 32]),
/// )
/// .with_wait(Duration::from_secs(2))
/// .with_retention(Duration::from_secs(3600));
/// assert_eq!(claim.wait, Duration::from_secs(2));
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ClaimRequest {
    /// Tenant and endpoint.
    pub scope: Scope,
    /// The client's key.
    pub key: IdempotencyKey,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// How long the completed record is remembered (default 24 h).
    pub retention: Duration,
    /// How long to wait for an unfinished owner of the same key (default 5 s).
    pub wait: Duration,
    /// How long the owner may hold the key before the store may end its
    /// work by itself (a server-side backstop for an owner whose process
    /// froze); `None` (the default): no such limit.
    pub hold_limit: Option<Duration>,
}

impl ClaimRequest {
    /// A claim for `key` in `scope`, with the layer's default retention and
    /// wait and no hold limit.
    pub fn new(scope: Scope, key: IdempotencyKey, fingerprint: Fingerprint) -> Self {
        ClaimRequest {
            scope,
            key,
            fingerprint,
            retention: Duration::from_secs(24 * 3600),
            wait: Duration::from_secs(5),
            hold_limit: None,
        }
    }

    /// Sets [`retention`](Self::retention).
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Sets [`wait`](Self::wait).
    pub fn with_wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Sets [`hold_limit`](Self::hold_limit).
    pub fn with_hold_limit(mut self, limit: Duration) -> Self {
        self.hold_limit = Some(limit);
        self
    }
}

/// The answer to a claim.
#[derive(Debug)]
#[non_exhaustive]
pub enum Claim<T> {
    /// This request owns the key; `T` is the transaction handle the handler
    /// writes through. Finish it with [`Store::complete`] or [`Store::abort`].
    Owned(T),
    /// The key has a completed, unexpired record.
    Completed(Record),
    /// Another request still owns the key and did not finish within the wait.
    InProgress,
}

/// A storage backend for idempotency records.
///
/// Methods return `impl Future + Send`; implementations may write `async fn`.
/// See the [module docs](self) for the guarantees an implementation owes.
pub trait Store: Clone + Send + Sync + 'static {
    /// The transaction handle an owner's handler writes through; it is put in
    /// the request extensions.
    type Tx: Clone + Send + Sync + 'static;

    /// Arbitrates the key: owns it, finds its completed record, or reports it in progress.
    fn claim(
        &self,
        request: &ClaimRequest,
    ) -> impl Future<Output = Result<Claim<Self::Tx>, StoreError>> + Send;

    /// Remembers `response` and commits it together with the handler's writes.
    ///
    /// On error nothing was committed, except for
    /// [`StoreErrorKind::OutcomeUnknown`]: the connection was lost during the
    /// commit itself, and a retry finds out. Return
    /// [`StoreErrorKind::TransactionAborted`] when committing again would fail
    /// the same way (a constraint), [`StoreErrorKind::Conflict`] when it may
    /// succeed.
    fn complete(
        &self,
        tx: Self::Tx,
        response: &StoredResponse,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Rolls the owner's work back and frees the key.
    fn abort(&self, tx: Self::Tx) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// The stable category of a [`StoreError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// The backend could not be reached in time (pool exhausted, connection
    /// refused or lost, timeout). Retrying later may succeed.
    Unavailable,
    /// The transaction can no longer commit, and trying again fails the same
    /// way: an earlier statement failed (and the handler went on), a
    /// constraint failed at commit, or the handle was already finished.
    /// Nothing was committed.
    TransactionAborted,
    /// The transaction conflicted with a concurrent one (a serialization
    /// failure, a deadlock) and was rolled back; trying again may succeed.
    Conflict,
    /// The connection was lost while committing: the commit may or may not
    /// have happened. A retry with the same key finds out.
    OutcomeUnknown,
    /// A long-running operation's lease no longer holds this owner's token:
    /// another owner took the operation over. Nothing was changed; the
    /// stale owner must stop.
    Fenced,
    /// A stored record could not be decoded.
    Corrupt,
    /// The schema is missing or from an unknown version.
    Schema,
    /// Any other backend error.
    Backend,
}

impl StoreErrorKind {
    /// A stable machine-readable name, e.g. `store_unavailable`.
    pub fn code(self) -> &'static str {
        match self {
            StoreErrorKind::Unavailable => "store_unavailable",
            StoreErrorKind::TransactionAborted => "transaction_aborted",
            StoreErrorKind::Conflict => "transaction_conflict",
            StoreErrorKind::OutcomeUnknown => "commit_outcome_unknown",
            StoreErrorKind::Fenced => "lease_fenced",
            StoreErrorKind::Corrupt => "record_corrupt",
            StoreErrorKind::Schema => "schema_mismatch",
            StoreErrorKind::Backend => "store_error",
        }
    }
}

/// An error from a [`Store`].
pub struct StoreError {
    kind: StoreErrorKind,
    message: String,
    sql_state: Option<String>,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl StoreError {
    /// An error of `kind` with a message (no request data in it, please).
    pub fn new(kind: StoreErrorKind, message: impl Into<String>) -> Self {
        StoreError {
            kind,
            message: message.into(),
            sql_state: None,
            source: None,
        }
    }

    /// Attaches the underlying error.
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// Records the SQLSTATE a SQL backend answered with.
    pub fn with_sql_state(mut self, code: Option<String>) -> Self {
        self.sql_state = code;
        self
    }

    /// The category.
    pub fn kind(&self) -> StoreErrorKind {
        self.kind
    }

    /// The SQLSTATE behind this error, for SQL backends (e.g. `55P03`).
    pub fn sql_state(&self) -> Option<&str> {
        self.sql_state.as_deref()
    }
}

impl fmt::Debug for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreError")
            .field("kind", &self.kind)
            .field("message", &self.message)
            .field("sql_state", &self.sql_state)
            .field("source", &self.source)
            .finish()
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.code(), self.message)?;
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|e| e as _)
    }
}
