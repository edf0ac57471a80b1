//! Deadlines the layer keeps itself around a request's calls to its store.
//!
//! A server-side timeout (`lock_timeout`, `idle_in_transaction_session_timeout`)
//! bounds the database's side only while the network carries its answer.
//! Across a partition (packets dropped, nothing reset) no answer comes, and
//! the kernel gives up on unacknowledged data only after its retransmissions
//! (minutes). So each call has a deadline of the process's own: past it the
//! call's future is dropped, which closes the connection it held (a store
//! never pools a connection that may be inside a transaction), and the
//! request is answered `503 store_unavailable`. The store's own waits (the
//! lock wait, the commit's patience, a cancel) end within these deadlines
//! when the database answers, so only a database that does not is cut off.

use std::{future::Future, time::Duration};

use futures_util::FutureExt as _;
use tokio::time::Instant;

use crate::store::{StoreError, StoreErrorKind};

/// Room past the wait for the claim: taking (or opening) a pooled
/// connection, the round trip, and the server's report of its own lock
/// timeout.
const CLAIM_MARGIN: Duration = Duration::from_secs(5);

/// What a request may take past its handler timeout, all told: ten seconds,
/// less two for the answer to leave and the margins above to round.
const PAST_HANDLER: Duration = Duration::from_secs(8);

/// The longest ending an owner's transaction may take: the commit's
/// patience with a statement a task of the handler still runs, a cancel,
/// and the cancelled statement's grace.
const END_LIMIT: Duration = Duration::from_secs(13);

/// The least time an end gets, however late the request already is: a
/// commit that the database would answer in a millisecond is not given up
/// unsent.
const END_FLOOR: Duration = Duration::from_secs(1);

/// A request's deadlines, fixed when its flow starts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadlines {
    wait: Instant,
    request: Instant,
}

impl Deadlines {
    /// For a request whose concurrent-duplicate wait ends at `wait`, and
    /// whose handler may run `handler_timeout`.
    pub(crate) fn new(wait: Instant, handler_timeout: Duration) -> Self {
        Deadlines {
            wait,
            request: Instant::now() + handler_timeout.saturating_add(PAST_HANDLER),
        }
    }

    /// When a claim (or opening the transaction) must have been answered.
    pub(crate) fn claim(&self) -> Instant {
        self.wait.max(Instant::now()) + CLAIM_MARGIN
    }

    /// How long a second run of the owner (the one-commit mode's, on a key
    /// freed of an expired record) may take: the handler timeout, or what
    /// is left of the request's budget once its end is set aside, if less.
    pub(crate) fn rerun(&self, handler_timeout: Duration) -> Duration {
        let left = self
            .request
            .saturating_duration_since(Instant::now())
            .saturating_sub(END_FLOOR);
        handler_timeout.min(left)
    }

    /// When ending the owner's transaction (its commit, or its rollback),
    /// starting now, must have been answered.
    pub(crate) fn end(&self) -> Instant {
        let now = Instant::now();
        self.request.clamp(now + END_FLOOR, now + END_LIMIT)
    }
}

/// `call`, answered by `deadline`: past it the call is dropped (its
/// connection closed) and `late` is the answer.
///
/// A combinator rather than an `async fn`: an `async fn` would keep `call`
/// twice in its state (the argument and the timeout awaiting it), and the
/// owner's commit is the largest future of a request.
pub(crate) fn within<T>(
    deadline: Instant,
    call: impl Future<Output = Result<T, StoreError>>,
    late: impl FnOnce(Duration) -> StoreError,
) -> impl Future<Output = Result<T, StoreError>> {
    let started = Instant::now();
    tokio::time::timeout_at(deadline, call)
        .map(move |answered| answered.unwrap_or_else(|_| Err(late(started.elapsed()))))
}

/// The claim (or opening the transaction) was not answered in time.
pub(crate) fn claim_unanswered(waited: Duration) -> StoreError {
    StoreError::new(
        StoreErrorKind::Unavailable,
        format!(
            "the database did not answer the claim within {} ms; its connection was closed",
            waited.as_millis()
        ),
    )
}

/// The commit was not answered in time: it may have reached the server.
pub(crate) fn commit_unanswered(waited: Duration) -> StoreError {
    StoreError::new(
        StoreErrorKind::OutcomeUnknown,
        format!(
            "the database did not answer the commit within {} ms; its connection was closed, \
             and whether the commit happened is unknown",
            waited.as_millis()
        ),
    )
}

/// The rollback was not answered in time: the connection is closed, and
/// the server rolls back once it learns so.
pub(crate) fn rollback_unanswered(waited: Duration) -> StoreError {
    StoreError::new(
        StoreErrorKind::Unavailable,
        format!(
            "the database did not answer the rollback within {} ms; its connection was closed",
            waited.as_millis()
        ),
    )
}
