//! Stores: where keys are arbitrated and responses remembered.
//!
//! [`PgStore`](crate::postgres::PgStore) is the production store;
//! [`MemoryStore`](crate::memory::MemoryStore) keeps the same contract in
//! memory for unit tests and as the reference for custom stores;
//! `tower_idempotency::sqlx::SqlxStore` (feature `sqlx`) is the store on a
//! `sqlx::PgPool`, a second backend written from this trait alone. Every
//! store keeps this contract:
//!
//! 1. **One owner.** For one `(scope, key)` at most one [`Claim::Owned`] is
//!    outstanding at a time, and at most one owner ever completes while the
//!    record lives.
//! 2. **Atomic completion.** [`Store::complete`] makes the remembered response
//!    and every write the handler made through the transaction handle durable
//!    together, or none of them.
//! 3. **Abort frees the key.** After [`Store::abort`] (or a failed
//!    `complete`, or when every clone of the handle is dropped unfinished)
//!    nothing the owner wrote exists and the next claim owns the key.
//! 4. **Bounded waiting.** A claim that meets an unfinished owner waits at most
//!    [`ClaimRequest::wait`], then answers [`Claim::InProgress`].
//! 5. **Tenant isolation.** The key is the whole `(tenant, endpoint, key)`:
//!    the same raw key of two tenants, or of two endpoints, names two
//!    operations.
//! 6. **Expiry.** A record whose retention has passed is taken over by the next
//!    claim as a new operation.
//!
//! Long-running operations (leases and fencing tokens) add [`LeaseStore`];
//! the one-commit mode, where the commit itself claims the key, adds
//! [`CommitStore`].
//!
//! Writing a store (two worked stores to read beside the [`Store`] trait's
//! per-method contract) and checking it with the conformance suite, which
//! names the part of this contract each failure breaks:
//! [custom stores](crate::guide::custom_stores).

use std::{fmt, future::Future, time::Duration};

mod commit;
pub(crate) mod id;
mod key_record;
mod lease;
pub(crate) mod limits;

pub(crate) use id::OperationId;

pub use commit::{CommitStore, Committed};
pub use key_record::{KeyRecord, KeyState};
pub use lease::{
    Acquired, Backoff, LeaseRequest, LeaseStore, Operation, OperationState, Owned, Recovered,
    StoredRequest,
};

use crate::{
    fingerprint::Fingerprint,
    key::IdempotencyKey,
    record::{Record, StoredResponse},
    scope::Scope,
};

/// The longest wait a store is given: PostgreSQL's longest lock timeout
/// (`i32::MAX` milliseconds, about 24.8 days).
pub(crate) const MAX_WAIT: Duration = Duration::from_millis(i32::MAX as u64);
/// The longest retention and backoff: 100 years.
pub(crate) const MAX_RETENTION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// A lease and a retention given to a store, held to what it can keep.
pub(crate) fn bounded(lease: Duration, retention: Duration) -> (Duration, Duration) {
    (lease.min(MAX_WAIT), retention.min(MAX_RETENTION))
}

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
    /// How long the record is remembered, counted from the claim (in the
    /// one-commit mode, from the commit; default 24 h).
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

    /// Sets [`retention`](Self::retention) (at most 100 years).
    pub fn with_retention(self, retention: Duration) -> Self {
        crate::setter::with(self, |c| c.retention = retention.min(MAX_RETENTION))
    }

    /// Sets [`wait`](Self::wait) (at most PostgreSQL's longest lock
    /// timeout, about 24.8 days).
    pub fn with_wait(self, wait: Duration) -> Self {
        crate::setter::with(self, |c| c.wait = wait.min(MAX_WAIT))
    }

    /// Sets [`hold_limit`](Self::hold_limit).
    pub fn with_hold_limit(self, limit: Duration) -> Self {
        crate::setter::with(self, |c| c.hold_limit = Some(limit))
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
/// The layer calls [`claim`](Self::claim) once per request that carries a
/// key; an owner's request then ends in exactly one of
/// [`complete`](Self::complete) (the handler's answer is to be remembered)
/// or [`abort`](Self::abort) (it is not: a 5xx, an error, a timeout),
/// unless its future is dropped, in which case the handle is dropped
/// unfinished. The [module docs](self) list the guarantees; each method
/// below says what it owes to them.
///
/// Methods return `impl Future + Send`; implementations may write `async fn`
/// (the futures must be `Send`: the layer spawns the owner's work). Every
/// error is a [`StoreError`] whose [`StoreErrorKind`] the layer turns into
/// a response with a stable `code`; no method may panic on what a request
/// or the backend can produce.
///
/// # The transaction handle
///
/// [`Tx`](Self::Tx) is what the owner's handler writes through (the layer
/// puts a clone in the request extensions): for a SQL store, the claim's
/// own open transaction, in which the key is held. Its clones share one
/// transaction.
///
/// - Statements through a handle whose transaction ended (completed,
///   aborted) must fail, not run outside it.
/// - Dropping every clone unfinished (a panicking handler, a cancelled
///   future, a spawned task that leaked a clone and ended) must act as
///   [`abort`](Self::abort): roll back and free the key, without waiting
///   for anyone. `Drop` cannot await, so close the connection (the server
///   rolls back) or queue the rollback where the connection cannot be lent
///   out before it ran, as `sqlx`'s pool does; never return a connection
///   with the transaction open.
///
/// # Examples
///
/// [`examples/custom_store.rs`](https://github.com/tower-idempotency/tower-idempotency/blob/main/examples/custom_store.rs)
/// wraps an existing store; the `sqlx` backend
/// ([`src/sqlx/`](https://github.com/tower-idempotency/tower-idempotency/tree/main/src/sqlx),
/// feature `sqlx`) implements the trait for another driver.
pub trait Store: Clone + Send + Sync + 'static {
    /// The transaction handle an owner's handler writes through; it is put in
    /// the request extensions. See [the trait docs](Self#the-transaction-handle).
    type Tx: Clone + Send + Sync + 'static;

    /// Arbitrates the key `(request.scope, request.key)`: owns it, finds its
    /// completed record, or reports it in progress.
    ///
    /// **Atomic with what.** Deciding the owner and holding the key must be
    /// one atomic step of the backend: an insert that a unique constraint
    /// arbitrates (`INSERT … ON CONFLICT`), a compare-and-set. Never look
    /// first and insert after: two claims that both looked before either
    /// inserted would both own the key. For a SQL store the owner's row is
    /// inserted in the transaction the handle then carries, so that it stays
    /// held (and invisible) until that transaction ends.
    ///
    /// **Answers.**
    /// - [`Claim::Owned`] for a key nobody holds, for a record whose
    ///   retention ended (taken over as a new operation: the old record is
    ///   replaced when the new owner completes), and for a record left
    ///   in progress by no live owner. The record will be remembered for
    ///   [`ClaimRequest::retention`] from this claim (not from its
    ///   completion: the owner's work is bounded by the handler's timeout,
    ///   and a completion that leaves the expiry alone is a cheap update for
    ///   a SQL store).
    /// - [`Claim::Completed`] for an unexpired completed record, with the
    ///   fingerprint of the request that created it: the layer compares it
    ///   (a different one is a reused key, refused); the store does not.
    /// - [`Claim::InProgress`] once another owner held the key for all of
    ///   [`ClaimRequest::wait`]. Wait for the owner to finish (then answer
    ///   its record, or own the key if it aborted), but never longer than
    ///   the wait: a lock wait that runs out is this answer, not an error.
    ///
    /// [`ClaimRequest::hold_limit`], if set, may end an owner that holds the
    /// key longer than that (a backstop for a frozen process); a store may
    /// ignore it.
    ///
    /// **Cancelled.** The future may be dropped at any await (a client gone
    /// before the key was owned, a server shutting down). Whatever it had
    /// begun must then hold nothing: a row it inserted rolls back with its
    /// transaction, a wait it registered goes away.
    ///
    /// **Errors.** [`StoreErrorKind::Unavailable`] when the backend could
    /// not be reached or did not answer in time (no connection from the
    /// pool, the claim's own deadline passed);
    /// [`StoreErrorKind::Schema`] when the table is missing;
    /// [`StoreErrorKind::Corrupt`] when the stored record does not decode;
    /// [`StoreErrorKind::Backend`] otherwise. An error owns nothing.
    fn claim(
        &self,
        request: &ClaimRequest,
    ) -> impl Future<Output = Result<Claim<Self::Tx>, StoreError>> + Send;

    /// Remembers `response` and commits it together with the handler's
    /// writes.
    ///
    /// **Atomic with what.** The response, every write made through `tx`
    /// (and its clones) and the check that `tx` still owns the key are one
    /// commit: all of them or none. Check ownership inside that commit
    /// (a `WHERE attempt_token = …` that must match, a transaction that is
    /// still the claim's): a handle that lost the key (aborted through a
    /// clone, ended by the backend, its key taken over) must not overwrite
    /// the current owner's record. Never store the response apart from the
    /// writes (before them, or after them in a second transaction): a
    /// failure between the two would remember an answer whose writes never
    /// happened, or the reverse. The response includes its
    /// [`resource_id`](crate::record::StoredResponse::resource_id), if any:
    /// keep it with the response and give it back with the record.
    ///
    /// **Errors.** On any error nothing was committed and the key is free
    /// again (roll back before returning), except for
    /// [`StoreErrorKind::OutcomeUnknown`]: the connection was lost during
    /// the commit itself, and a retry with the same key finds out. Return
    /// [`StoreErrorKind::TransactionAborted`] when committing again would
    /// fail the same way (a statement of the handler failed, a constraint
    /// failed at commit, `tx` already finished or no longer owns the key),
    /// [`StoreErrorKind::Conflict`] when it may succeed (a serialization
    /// failure, a deadlock), [`StoreErrorKind::Unavailable`] when the
    /// backend could not be reached before the commit was sent.
    ///
    /// **Cancelled.** Dropped before it returns, the commit happens whole or
    /// not at all (the layer drives it to its end on a task of its own, but
    /// a store must not depend on that).
    fn complete(
        &self,
        tx: Self::Tx,
        response: &StoredResponse,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Rolls the owner's work back and frees the key.
    ///
    /// Everything written through `tx` is discarded and the next claim owns
    /// the key at once (not after a lease or a timeout). Aborting a
    /// transaction that already ended is a no-op that returns `Ok(())`.
    ///
    /// **Errors.** [`StoreErrorKind::Unavailable`] when the rollback could
    /// not be sent; the key must still end up free (a connection that could
    /// not roll back is closed, and the server rolls back).
    fn abort(&self, tx: Self::Tx) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The key's completed, unexpired record, read without claiming
    /// anything; `None` when there is none, or when the store does not
    /// read ahead of a claim (the default).
    ///
    /// The layer calls it before [`claim`](Self::claim) for a request that
    /// says it is a retry ([`IDEMPOTENCY_ATTEMPT`] above 1) and that the
    /// replay cache did not answer: one read, nothing written, instead of a
    /// transaction that inserts and finds the row taken. The answer is only
    /// a shortcut: when it is `None` the claim still arbitrates the key, so
    /// a store that reads nothing here (the default) loses no guarantee.
    ///
    /// **What it may return.** Exactly what [`claim`](Self::claim) would
    /// answer [`Claim::Completed`] with at this moment, or `None`: never an
    /// expired record (retention over: a new operation), never a row in
    /// progress. For a SQL store, one statement in autocommit (a fresh
    /// snapshot), which waits for no lock.
    ///
    /// **Errors.** As for [`claim`](Self::claim); the layer answers them as
    /// it answers a failed claim.
    ///
    /// [`IDEMPOTENCY_ATTEMPT`]: crate::record::IDEMPOTENCY_ATTEMPT
    fn lookup(
        &self,
        request: &ClaimRequest,
    ) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send {
        let _ = request;
        std::future::ready(Ok(None))
    }
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
#[derive(Debug)]
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
    pub fn with_source(self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        crate::setter::with(self, |s| s.source = Some(Box::new(source)))
    }

    /// Records the SQLSTATE a SQL backend answered with.
    pub fn with_sql_state(self, code: Option<String>) -> Self {
        crate::setter::with(self, |s| s.sql_state = code)
    }

    /// The category.
    pub fn kind(&self) -> StoreErrorKind {
        self.kind
    }

    /// The SQLSTATE behind this error, for SQL backends (e.g. `55P03`).
    pub fn sql_state(&self) -> Option<&str> {
        self.sql_state.as_deref()
    }

    /// The answer for a handler that gives up on this error (a
    /// [`SqlxTx`](crate::sqlx::SqlxTx) handler's statement, a fenced
    /// commit), by its [`kind`](Self::kind): `503 store_unavailable` with
    /// `Retry-After` for [`Unavailable`](StoreErrorKind::Unavailable),
    /// [`Conflict`](StoreErrorKind::Conflict) and
    /// [`OutcomeUnknown`](StoreErrorKind::OutcomeUnknown), `503
    /// operation_taken_over` for [`Fenced`](StoreErrorKind::Fenced), `500
    /// statement_failed` for the rest. The same answers as
    /// `TxError::to_problem` gives `PgTx` handlers; the body carries neither
    /// the message nor the SQLSTATE.
    ///
    /// With the `axum` feature `StoreError` is an `IntoResponse` built from
    /// this; with `sqlx`, a `sqlx::Error` converts into a `StoreError`
    /// (sorted by SQLSTATE), so a `SqlxTx` handler returns
    /// `Result<_, StoreError>` and uses `?` on its queries.
    pub fn to_problem(&self) -> crate::problem::Problem {
        crate::problem::statement_failed(self.kind)
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.code(), self.message)?;
        // The whole chain: a pool error says only "error performing TLS
        // handshake" or "db error"; the reason (an unverified certificate,
        // the server's refusal) is further down. A cause whose text its
        // wrapper already printed is not repeated.
        let mut printed = String::new();
        let mut cause = self.source.as_deref().map(|e| e as &dyn std::error::Error);
        while let Some(e) = cause {
            let text = e.to_string();
            if !printed.contains(&text) {
                write!(f, ": {text}")?;
                printed.push_str(&text);
            }
            cause = e.source();
        }
        Ok(())
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|e| e as _)
    }
}
