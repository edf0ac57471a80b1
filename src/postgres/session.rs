//! [`Session`]: the crate's one way into the store's pool outside the
//! claim protocol, for the outbox relay, retention cleanup, the operator API
//! and migrations.
//!
//! It exists so that those users neither map driver errors themselves (every
//! method answers [`StoreError`], sorted as the store sorts them) nor touch
//! the connection guard's state: a session returns to the pool only once
//! its last statement was answered outside any transaction
//! ([`Session::answered`]) or its `COMMIT` was acknowledged
//! ([`Session::commit`], [`Session::mark_clean`]); otherwise it is closed,
//! and PostgreSQL rolls back. A session starts that way: a statement cut off
//! mid-flight (a deadline, a dropped future) leaves an answer owed on the
//! connection, which no one else may receive.
//!
//! The methods are thin: each sends the crate's [`Sql`] as the store sends
//! its statements (prepared and cached per connection, or unnamed behind a
//! transaction pooler; see `prepared.rs`), so futures joined with
//! `tokio::try_join!` are pipelined in one round trip as with the driver's
//! own. Prepare ([`Session::prepare`]) what goes into a pipeline first.

use tokio_postgres::{types::ToSql, Row};

use super::{
    conn::Conn,
    error::map_error,
    prepared::{Prepared, Sql},
    PgStore,
};
use crate::{protocol::transaction::COMMIT, store::StoreError};

/// A pooled connection for the crate's own statements; see the module docs.
pub(crate) struct Session {
    conn: Conn,
}

/// Proof that a session's `COMMIT` was acknowledged, for
/// [`Session::mark_clean`]. Only [`Session::commit`] makes one.
#[must_use = "pass it to Session::mark_clean, or the connection is closed"]
pub(crate) struct Committed(());

impl PgStore {
    /// A pooled connection for the crate's own statements, outside any
    /// transaction; waits up to the acquire timeout.
    pub(crate) async fn session(&self) -> Result<Session, StoreError> {
        let mut conn = self.conn().await?;
        conn.mark_dirty();
        Ok(Session { conn })
    }
}

/// The session's ways to run a statement: each the connection's own
/// ([`Conn`]'s, in `prepared.rs`) with its error sorted by [`map_error`].
macro_rules! forward_to_conn {
    ($($(#[$doc:meta])* fn $name:ident($arg:ident: $ty:ty) -> $out:ty = $conn:ident;)*) => {
        $(
            $(#[$doc])*
            pub(crate) async fn $name(
                &self,
                $arg: $ty,
                params: &[&(dyn ToSql + Sync)],
            ) -> Result<$out, StoreError> {
                self.conn.$conn($arg, params).await.map_err(map_error)
            }
        )*
    };
}

impl Session {
    /// Prepares `sql` for this connection: cached, or nothing to do when the
    /// store sends unnamed statements (see `prepared.rs`). Prepare what
    /// you pipeline before pipelining it.
    pub(crate) async fn prepare<'a>(&self, sql: Sql<'a>) -> Result<Prepared<'a>, StoreError> {
        self.conn.prepare_sql(sql).await.map_err(map_error)
    }

    forward_to_conn! {
        /// Runs a prepared statement and returns the number of rows it affected.
        fn execute_prepared(statement: &Prepared<'_>) -> u64 = execute_prepared;
        /// Runs a prepared query and returns its rows.
        fn query_prepared(statement: &Prepared<'_>) -> Vec<Row> = query_prepared;
        /// Runs a prepared query that returns exactly one row.
        fn query_one_prepared(statement: &Prepared<'_>) -> Row = query_one_prepared;
        /// Runs a statement and returns the number of rows it affected.
        fn execute(sql: Sql<'_>) -> u64 = execute_sql;
        /// Runs a query and returns its rows.
        fn query(sql: Sql<'_>) -> Vec<Row> = query_sql;
        /// Runs a query that returns exactly one row.
        fn query_one(sql: Sql<'_>) -> Row = query_one_sql;
        /// Runs a query that returns at most one row.
        fn query_opt(sql: Sql<'_>) -> Option<Row> = query_opt_sql;
    }

    /// Runs statements without parameters, in one message (e.g. `BEGIN …`).
    pub(crate) async fn batch_execute(&self, sql: &str) -> Result<(), StoreError> {
        self.conn.batch_execute(sql).await.map_err(map_error)
    }

    /// Sends `COMMIT`; pipeline it behind the transaction's last statements
    /// with `tokio::try_join!` (`biased`) to save a round trip.
    pub(crate) async fn commit(&self) -> Result<Committed, StoreError> {
        self.batch_execute(COMMIT).await.map(|()| Committed(()))
    }

    /// Every statement sent outside a transaction was answered: the session
    /// may go back to the pool.
    pub(crate) fn answered(&mut self) {
        self.conn.mark_clean();
    }

    /// The `COMMIT` was acknowledged: the session may go back to the pool.
    pub(crate) fn mark_clean(&mut self, _committed: Committed) {
        self.conn.mark_clean();
    }
}
