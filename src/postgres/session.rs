//! [`Session`]: the crate's one way into the store's pool outside the
//! claim protocol, for the outbox relay, retention cleanup, the operator API
//! and migrations.
//!
//! It exists so that those users neither map driver errors themselves (every
//! method answers [`StoreError`], sorted as the store sorts them) nor touch
//! the connection guard's state: a session returns to the pool after plain
//! statements, and one that may be inside a transaction returns only once its
//! `COMMIT` was acknowledged ([`Session::mark_dirty`], [`Session::commit`],
//! [`Session::mark_clean`]); otherwise it is closed, and PostgreSQL rolls
//! back.
//!
//! The methods are thin: each sends exactly the statement the driver method
//! of the same name would (a `&str` is prepared unnamed, a
//! [`Statement`] from [`Session::prepare`] is cached per connection), so
//! futures joined with `tokio::try_join!` are pipelined in one round trip as
//! with the driver's own.

use tokio_postgres::{types::ToSql, Row, Statement, ToStatement};

use super::{conn::Conn, error::map_error, PgStore};
use crate::store::StoreError;

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
        Ok(Session {
            conn: self.conn().await?,
        })
    }
}

impl Session {
    /// Prepares `sql`, reusing this connection's cached statement.
    pub(crate) async fn prepare(&self, sql: &str) -> Result<Statement, StoreError> {
        self.conn.prepare_cached(sql).await.map_err(map_error)
    }

    /// Runs a statement and returns the number of rows it affected.
    pub(crate) async fn execute<T>(
        &self,
        statement: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, StoreError>
    where
        T: ?Sized + ToStatement,
    {
        self.conn
            .execute(statement, params)
            .await
            .map_err(map_error)
    }

    /// Runs a query and returns its rows.
    pub(crate) async fn query<T>(
        &self,
        statement: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, StoreError>
    where
        T: ?Sized + ToStatement,
    {
        self.conn.query(statement, params).await.map_err(map_error)
    }

    /// Runs a query that returns exactly one row.
    pub(crate) async fn query_one<T>(
        &self,
        statement: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, StoreError>
    where
        T: ?Sized + ToStatement,
    {
        self.conn
            .query_one(statement, params)
            .await
            .map_err(map_error)
    }

    /// Runs a query that returns at most one row.
    pub(crate) async fn query_opt<T>(
        &self,
        statement: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, StoreError>
    where
        T: ?Sized + ToStatement,
    {
        self.conn
            .query_opt(statement, params)
            .await
            .map_err(map_error)
    }

    /// Runs statements without parameters, in one message (e.g. `BEGIN …`).
    pub(crate) async fn batch_execute(&self, sql: &str) -> Result<(), StoreError> {
        self.conn.batch_execute(sql).await.map_err(map_error)
    }

    /// Call before sending `BEGIN`: from now on the session is closed when
    /// dropped (PostgreSQL rolls back) unless [`mark_clean`](Self::mark_clean)
    /// says the transaction was committed.
    pub(crate) fn mark_dirty(&mut self) {
        self.conn.mark_dirty();
    }

    /// Sends `COMMIT`; pipeline it behind the transaction's last statements
    /// with `tokio::try_join!` (`biased`) to save a round trip.
    pub(crate) async fn commit(&self) -> Result<Committed, StoreError> {
        self.batch_execute("COMMIT").await.map(|()| Committed(()))
    }

    /// The `COMMIT` was acknowledged: the session may go back to the pool.
    pub(crate) fn mark_clean(&mut self, _committed: Committed) {
        self.conn.mark_clean();
    }
}
