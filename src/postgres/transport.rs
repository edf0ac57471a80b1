//! [`Transport`] and [`Link`] for the tokio-postgres store: how the
//! protocol's statements travel on a pooled connection. A statement alone
//! in a transaction goes out with its `BEGIN` and `COMMIT` in one round
//! trip; every statement is prepared and cached per connection, or unnamed
//! behind a transaction pooler (`prepared.rs`).

use std::time::Duration;

use tokio::time::Instant;
use tokio_postgres::Row;

use super::{conn::Conn, error::map_error, prepared::dyn_params, PgStore};
use crate::{
    protocol::{
        claim::begin_with_waits,
        errors::ends_only_the_statement,
        sql::{Param, Sql},
        transaction::{BEGIN, COMMIT, ROLLBACK},
        transport::{Link, Transport},
        waits::GRACE,
    },
    store::{StoreError, StoreErrorKind},
};

impl Link for Conn {
    type Row = Row;

    async fn query(
        &mut self,
        sql: Sql<'static>,
        params: &[Param<'_>],
    ) -> Result<Vec<Row>, StoreError> {
        self.query_sql(sql, &dyn_params(params))
            .await
            .map_err(map_error)
    }

    /// The statement between `BEGIN ISOLATION LEVEL READ COMMITTED` and
    /// `COMMIT`, the three pipelined: one round trip. The connection is
    /// outside any transaction here (the store's own statements on a clean
    /// connection); should any of the three fail, it is closed, not pooled.
    async fn write_alone(
        &mut self,
        sql: Sql<'static>,
        params: &[Param<'_>],
    ) -> Result<Vec<Row>, StoreError> {
        // Prepared before the pipeline, as in `transaction`.
        let statement = self.prepare_sql(sql).await.map_err(map_error)?;
        let params = dyn_params(params);
        self.mark_dirty();
        let (_, rows, _) = tokio::try_join!(
            biased;
            self.batch_pipelined(BEGIN),
            self.query_prepared(&statement, &params),
            self.batch_execute(COMMIT),
        )
        .map_err(map_error)?;
        self.mark_clean();
        Ok(rows)
    }
}

impl Transport for PgStore {
    type Row = Row;

    async fn read(
        &self,
        sql: Sql<'static>,
        params: &[Param<'_>],
        deadline: Instant,
    ) -> Result<Vec<Row>, StoreError> {
        bounded(deadline, async {
            let mut conn = self.conn().await?;
            // Until the answer is in, a cut-off statement would leave the
            // connection busy: it is closed rather than returned.
            conn.mark_dirty();
            let rows = conn
                .query_sql(sql, &dyn_params(params))
                .await
                .map_err(map_error)?;
            conn.mark_clean();
            Ok(rows)
        })
        .await
    }

    async fn transaction(
        &self,
        sql: Sql<'static>,
        params: &[Param<'_>],
        wait: Duration,
    ) -> Result<Vec<Row>, StoreError> {
        let mut conn = self.conn().await?;
        let deadline = Instant::now() + wait + GRACE;
        // Prepared before the pipeline: a statement prepared inside it would
        // let the COMMIT overtake its Bind.
        let statement = match bounded(deadline, async {
            conn.prepare_sql(sql).await.map_err(map_error)
        })
        .await
        {
            Ok(statement) => statement,
            Err(e) => {
                conn.mark_dirty();
                return Err(e);
            }
        };
        let begin = begin_with_waits(Some(wait), None);
        let params = dyn_params(params);
        conn.mark_dirty();
        let ran = tokio::time::timeout_at(deadline, async {
            tokio::try_join!(
                biased;
                conn.batch_pipelined(&begin),
                conn.query_prepared(&statement, &params),
                conn.batch_execute(COMMIT),
            )
        })
        .await;
        match ran {
            // Cut off mid-statement: `conn` stays dirty and is closed;
            // PostgreSQL rolls back.
            Err(_) => Err(timed_out()),
            Ok(Ok((_, rows, _))) => {
                conn.mark_clean();
                Ok(rows)
            }
            // A failed statement aborted the transaction, and the COMMIT
            // rolled back; unless the connection itself failed, make sure
            // it is idle before it goes back to the pool.
            Ok(Err(e)) => {
                let e = map_error(e);
                if e.kind() != StoreErrorKind::Unavailable
                    || e.sql_state().is_some_and(ends_only_the_statement)
                {
                    let _ = rollback(conn).await;
                }
                Err(e)
            }
        }
    }
}

/// Ends a transaction whose outcome does not matter; the connection goes
/// back to the pool only if that worked.
pub(super) async fn rollback(mut conn: Conn) -> Result<(), StoreError> {
    conn.batch_execute(ROLLBACK).await.map_err(map_error)?;
    conn.mark_clean();
    Ok(())
}

/// `work`, answered by `deadline` whatever the database does.
pub(super) async fn bounded<T>(
    deadline: Instant,
    work: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout_at(deadline, work)
        .await
        .unwrap_or_else(|_| Err(timed_out()))
}

/// The database did not answer in time.
pub(super) fn timed_out() -> StoreError {
    StoreError::new(
        StoreErrorKind::Unavailable,
        "the database did not answer within the wait",
    )
}
