//! [`Transport`] and [`Link`] for the sqlx store: how the protocol's
//! statements travel on a `PgPool`. sqlx sends one statement at a time, so
//! a statement alone in a transaction costs its `BEGIN`, the waits, the
//! statement and the `COMMIT` in round trips of their own; every statement
//! is prepared and cached by sqlx, or unnamed behind a transaction pooler
//! ([`SqlxStore::transaction_pooling`]).

use std::time::Duration;

use ::sqlx::{
    postgres::{PgArguments, PgRow},
    query::Query,
    PgConnection, Postgres, Row as _, Transaction,
};
use tokio::time::Instant;

use super::{error::map_error, SqlxStore};
use crate::{
    protocol::{
        claim::set_waits_then_pid,
        sql::{Param, Sql},
        transaction::BEGIN,
        transport::{Link, Transport},
        waits::GRACE,
    },
    store::{StoreError, StoreErrorKind},
};

crate::protocol::sql::columns!(PgRow);

/// `sql` with `params` bound, prepared and cached by sqlx or, behind a
/// transaction pooler, unnamed.
pub(super) fn query<'q>(
    sql: Sql<'static>,
    params: &[Param<'q>],
    transaction_pooling: bool,
) -> Query<'q, Postgres, PgArguments> {
    let mut query = ::sqlx::query(sql.text()).persistent(!transaction_pooling);
    for param in params {
        query = match *param {
            Param::Text(v) => query.bind(v),
            Param::OptText(v) => query.bind(v),
            Param::Bytea(v) => query.bind(v),
            Param::Int2(v) => query.bind(v),
            Param::Int4(v) => query.bind(v),
            Param::Int8(v) => query.bind(v),
            Param::Float8(v) => query.bind(v),
        };
    }
    query
}

/// A connection inside a transaction the store began.
pub(super) struct SqlxLink<'c> {
    pub(super) conn: &'c mut PgConnection,
    pub(super) transaction_pooling: bool,
}

impl Link for SqlxLink<'_> {
    type Row = PgRow;

    async fn query(
        &mut self,
        sql: Sql<'static>,
        params: &[Param<'_>],
    ) -> Result<Vec<PgRow>, StoreError> {
        query(sql, params, self.transaction_pooling)
            .fetch_all(&mut *self.conn)
            .await
            .map_err(map_error)
    }
}

impl SqlxLink<'_> {
    /// Sets the transaction's lock wait and idle limit
    /// ([`set_waits_then_pid`], one message); returns the session's process
    /// id, which a cancel request names.
    pub(super) async fn set_waits(
        &mut self,
        lock_wait: Option<Duration>,
        idle: Option<Duration>,
    ) -> Result<i32, StoreError> {
        let batch = set_waits_then_pid(lock_wait, idle);
        // A query without arguments goes out as one simple-query message.
        let rows = ::sqlx::Executor::fetch_all(&mut *self.conn, ::sqlx::AssertSqlSafe(batch))
            .await
            .map_err(map_error)?;
        let row = rows.last().ok_or_else(|| {
            StoreError::new(StoreErrorKind::Backend, "setting the waits returned no row")
        })?;
        row.try_get(0).map_err(map_error)
    }
}

impl Transport for SqlxStore {
    type Row = PgRow;

    async fn read(
        &self,
        sql: Sql<'static>,
        params: &[Param<'_>],
        deadline: Instant,
    ) -> Result<Vec<PgRow>, StoreError> {
        let read = async {
            let statement = query(sql, params, self.transaction_pooling);
            if !self.transaction_pooling {
                return statement.fetch_all(&self.pool).await.map_err(map_error);
            }
            // Behind a transaction pooler, in a transaction of its own: sqlx
            // prepares in a round trip of its own, which outside a
            // transaction the pooler may send to another server connection
            // than the execution. Dropped on an error, it rolls back.
            let mut tx = self.pool.begin_with(BEGIN).await.map_err(map_error)?;
            let rows = statement.fetch_all(&mut *tx).await.map_err(map_error)?;
            tx.commit().await.map_err(map_error)?;
            Ok(rows)
        };
        tokio::time::timeout_at(deadline, read)
            .await
            .unwrap_or_else(|_| Err(timed_out()))
    }

    async fn transaction(
        &self,
        sql: Sql<'static>,
        params: &[Param<'_>],
        wait: Duration,
    ) -> Result<Vec<PgRow>, StoreError> {
        let ran = async {
            let mut tx = self.pool.begin_with(BEGIN).await.map_err(map_error)?;
            let mut link = SqlxLink {
                conn: &mut tx,
                transaction_pooling: self.transaction_pooling,
            };
            let rows = match link.set_waits(Some(wait), None).await {
                Ok(_) => link.query(sql, params).await,
                Err(e) => Err(e),
            };
            match rows {
                Ok(rows) => {
                    tx.commit().await.map_err(map_error)?;
                    Ok(rows)
                }
                Err(e) => {
                    rollback(tx).await;
                    Err(e)
                }
            }
        };
        // Cut off mid-statement, the transaction is dropped: its connection
        // is closed, and the server rolls back.
        tokio::time::timeout(wait + GRACE, ran)
            .await
            .unwrap_or_else(|_| Err(timed_out()))
    }
}

async fn rollback(tx: Transaction<'static, Postgres>) {
    if let Err(e) = tx.rollback().await {
        tracing::debug!(error = %e, "rolling back a statement's transaction failed");
    }
}

/// The database did not answer in time.
pub(super) fn timed_out() -> StoreError {
    StoreError::new(
        StoreErrorKind::Unavailable,
        "the database did not answer within the wait",
    )
}
