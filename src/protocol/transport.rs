//! What a store gives the protocol to send its statements with: the whole
//! of a driver's part. [`Link`] is one connection inside a transaction the
//! store began (the claim's); [`Transport`] is the store's pool, for the
//! statements that run on their own (the long-running mode's, the
//! operator's). Each answers rows the protocol reads through [`Columns`],
//! and sorts the driver's errors into [`StoreError`] itself.

use std::{future::Future, time::Duration};

use tokio::time::Instant;

use super::sql::{Columns, Param, Sql};
use crate::store::StoreError;

/// A connection inside a transaction the store began.
pub(crate) trait Link: Send {
    /// A row of this driver.
    type Row: Columns + Send + Sync;

    /// Runs `sql` with `params` in the transaction and returns its rows.
    fn query(
        &mut self,
        sql: Sql<'static>,
        params: &[Param<'_>],
    ) -> impl Future<Output = Result<Vec<Self::Row>, StoreError>> + Send;

    /// Runs `sql`, a write, in a `READ COMMITTED` transaction: the one the
    /// link is in, or, for a link outside any transaction, one of its own
    /// around the statement (never the database's default isolation).
    fn write_alone(
        &mut self,
        sql: Sql<'static>,
        params: &[Param<'_>],
    ) -> impl Future<Output = Result<Vec<Self::Row>, StoreError>> + Send {
        self.query(sql, params)
    }
}

/// A store's pool, for statements that each run on their own.
pub(crate) trait Transport: Send + Sync {
    /// A row of this driver.
    type Row: Columns + Send + Sync;

    /// Reads with a fresh snapshot, without a transaction of the store's
    /// (behind a transaction pooler, in one of its own), answered by
    /// `deadline` whatever the database does.
    fn read(
        &self,
        sql: Sql<'static>,
        params: &[Param<'_>],
        deadline: Instant,
    ) -> impl Future<Output = Result<Vec<Self::Row>, StoreError>> + Send;

    /// Runs `sql` alone in a transaction whose lock waits last at most
    /// `wait`, and commits it; its rows. A lock wait that ran out is the
    /// error with SQLSTATE `55P03`. Answered within `wait` and the
    /// protocol's grace whatever the database does; cut off, the
    /// connection is closed and the server rolls back.
    fn transaction(
        &self,
        sql: Sql<'static>,
        params: &[Param<'_>],
        wait: Duration,
    ) -> impl Future<Output = Result<Vec<Self::Row>, StoreError>> + Send;
}
