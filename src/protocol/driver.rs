//! The seam between the protocol and a PostgreSQL client library: what a
//! driver can do, and nothing of what it means.
//!
//! A driver implements two traits, in one file of its own: [`Driver`] for
//! its pool (a connection; a statement run on its own) and [`Connection`]
//! for one pooled connection (begin with the first statements, query, end,
//! cancel; and a batch, for the migration runner). Everything above the seam (`owner.rs`: the claim, the
//! completion, the one-commit commit, the fenced transaction, what a failed
//! end means; `lease.rs`; `migrations.rs`) is written once against these
//! traits and never names a driver.
//!
//! A driver reports facts: the error of the step that failed, sorted into a
//! [`StoreError`] by [`errors::kind_of`](super::errors::kind_of) for the
//! server's errors, and, for an end, which step it was and whether the
//! `COMMIT` may have reached the server. What a SQLSTATE or a lost
//! connection means for the key is decided above the seam, once.
//!
//! A driver that pipelines sends a `BEGIN` with its first statements, and a
//! deciding statement with its `COMMIT` and the session reset, each in one
//! round trip; one that sends one statement at a time sends them in turn.
//! Either way the protocol sees the same steps.

use std::{future::Future, time::Duration};

use tokio::time::Instant;

use super::sql::{Columns, Param, Sql};
use crate::store::StoreError;

/// A driver's pool: where connections come from, and the statements that
/// each run on their own (the long-running mode's, the operator's, a lost
/// commit's look at the winner).
pub(crate) trait Driver: Clone + Send + Sync + 'static {
    /// A row of this driver.
    type Row: Columns + Send + Sync;
    /// One of its pooled connections.
    type Conn: Connection<Row = Self::Row>;

    /// A pooled connection outside any transaction, waiting at most the
    /// pool's acquire timeout.
    fn connect(&self) -> impl Future<Output = Result<Self::Conn, StoreError>> + Send;

    /// Whether the database is a Citus coordinator: known, or asked on
    /// `conn` (once per store; `None` if the question failed). The claim is
    /// sent as separate statements there ([`citus`](super::citus)). A
    /// driver that does not tell answers `Some(false)`.
    fn learn_citus(&self, conn: &mut Self::Conn) -> impl Future<Output = Option<bool>> + Send;

    /// Reads with a fresh snapshot, without a transaction of the store's
    /// (behind a transaction pooler, in one of its own), answered by
    /// `deadline` whatever the database does.
    fn read(
        &self,
        sql: Sql<'static>,
        params: &[Param<'_>],
        deadline: Instant,
    ) -> impl Future<Output = Result<Vec<Self::Row>, StoreError>> + Send;

    /// Runs `sql` alone in a `READ COMMITTED` transaction whose lock waits
    /// last at most `wait`, and commits it; its rows. A lock wait that ran
    /// out is the error with SQLSTATE `55P03`. Answered within `wait` and
    /// the protocol's grace whatever the database does; cut off, the
    /// connection is closed and the server rolls back.
    fn transaction(
        &self,
        sql: Sql<'static>,
        params: &[Param<'_>],
        wait: Duration,
    ) -> impl Future<Output = Result<Vec<Self::Row>, StoreError>> + Send;

    /// Where the connections go, as the store's spans name it (asked only
    /// when a span is recorded).
    fn target(&self) -> super::telemetry::Target;
}

/// The limits a transaction sets for itself (`SET LOCAL`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Waits {
    /// `lock_timeout`: how long a lock wait inside may last.
    pub(crate) lock: Option<Duration>,
    /// `idle_in_transaction_session_timeout`: how long the transaction may
    /// sit idle before the server ends the session (the hold limit). A
    /// driver whose sessions already carry the same limit need not set it.
    pub(crate) idle: Option<Duration>,
}

/// A statement and its parameters.
#[derive(Clone, Copy)]
pub(crate) struct Statement<'a> {
    pub(crate) sql: Sql<'static>,
    pub(crate) params: &'a [Param<'a>],
}

/// The statement that decides whether a transaction may commit (the
/// completion, the one-commit claim, the fenced check), sent just before
/// the `COMMIT`.
#[derive(Clone, Copy)]
pub(crate) struct Deciding<'a> {
    /// The statement.
    pub(crate) sql: Sql<'static>,
    /// The same statement with the session reset in it, taking the reset's
    /// two arguments (the hold limit and the login role, each text or
    /// `NULL`) after `params`: a driver that resets the session itself may
    /// send it instead of `sql` and a reset of its own, where it knows the
    /// reset may run inside the transaction (not behind a transaction
    /// pooler, not on Citus).
    pub(crate) resetting: Option<Sql<'static>>,
    pub(crate) params: &'a [Param<'a>],
}

/// How a transaction ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    /// `COMMIT`, then the session reset.
    Commit,
    /// `ROLLBACK`, then the session reset: the handler had the session.
    Rollback,
    /// `ROLLBACK` of a transaction no handler touched (a claim that did not
    /// win the key, a fenced transaction refused): no reset is due.
    Unused,
}

/// Which step of an end failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// The deciding statement (or its preparation).
    Deciding,
    /// The `COMMIT` or `ROLLBACK`.
    End,
}

/// An end that failed, as facts. The connection is closed, not pooled
/// again, unless the transaction is known to be over and the session
/// reset.
#[derive(Debug)]
pub(crate) struct Failed {
    pub(crate) step: Step,
    pub(crate) error: StoreError,
    /// Whether the `COMMIT` was sent (pipelined behind a deciding statement
    /// that then failed, or sent on its own): a connection lost after that
    /// leaves the outcome unknown.
    pub(crate) commit_sent: bool,
    /// Whether the connection itself failed (closed, broken, unreadable),
    /// as the driver tells from its own error.
    pub(crate) connection_lost: bool,
}

/// One pooled connection.
///
/// From [`begin`](Self::begin) (or [`begin_later`](Self::begin_later)) on,
/// a connection dropped before its [`end`](Self::end) succeeded is closed
/// instead of going back to the pool, and the server rolls back: nothing
/// can put an open transaction back into the pool.
pub(crate) trait Connection: Send + Sized + 'static {
    /// A row of this driver.
    type Row: Columns + Send + Sync;
    /// What cancels the statement running on this connection.
    type Cancel: Cancel;

    /// Begins a `READ COMMITTED` transaction with `waits` and runs `first`
    /// in it: one round trip where the driver pipelines. Each statement's
    /// rows, in order.
    fn begin(
        &mut self,
        waits: Waits,
        first: &[Statement<'_>],
    ) -> impl Future<Output = Result<Vec<Vec<Self::Row>>, StoreError>> + Send;

    /// Begins a transaction with `waits` for a handler's statements: sent
    /// with the first of them where the driver can (a lost connection
    /// before that costs nothing: the transaction starts over on another),
    /// else now.
    fn begin_later(&mut self, waits: Waits) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Runs `sql` with `params` in the transaction and returns its rows.
    fn query(
        &mut self,
        sql: Sql<'static>,
        params: &[Param<'_>],
    ) -> impl Future<Output = Result<Vec<Self::Row>, StoreError>> + Send;

    /// Sends `sql` (statements of the crate's own, without parameters) as
    /// one simple-query message, inside or outside a transaction: the
    /// migration runner's way to begin and commit. From here on the
    /// connection is closed rather than pooled again, until
    /// [`settled`](Self::settled).
    fn batch(&mut self, sql: &str) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Every statement sent with [`batch`](Self::batch) or
    /// [`query`](Self::query) was answered, and the last transaction
    /// committed: the connection may go back to the pool.
    fn settled(&mut self);

    /// Ends the transaction: `deciding`, if any, then `end`, then the
    /// session reset where one is due (none behind a transaction pooler,
    /// where it would reach another server connection). Where the driver
    /// pipelines, one round trip; the `COMMIT` must not go out before the
    /// deciding statement was sent, and a deciding statement that fails
    /// makes the `COMMIT` roll back. A statement still running on the
    /// connection (a handler's, cut off) is waited for. The connection goes
    /// back to the pool only if all of it is known to have worked.
    fn end(
        self,
        deciding: Option<Deciding<'_>>,
        end: End,
    ) -> impl Future<Output = Result<(), Failed>> + Send;

    /// What cancels the statement running on this connection now.
    fn canceller(&self) -> Self::Cancel;
}

/// Cancels the statement running on one connection.
pub(crate) trait Cancel: Clone + Send + Sync + 'static {
    /// Sends the cancel request; whether it was delivered.
    fn cancel(&self) -> impl Future<Output = Result<(), StoreError>> + Send;
}
