//! The [driver seam](crate::protocol::driver) for sqlx: how the protocol's
//! statements travel on a `PgPool`. This file only sends; what the answers
//! mean is decided in `crate::protocol`.
//!
//! sqlx sends one statement at a time: a transaction's `BEGIN`, its waits
//! and the session's process id go out as one simple-query message, and
//! each statement after it, the deciding statement, the `COMMIT` and the
//! session reset in round trips of their own. Every statement is prepared
//! and cached by sqlx, or unnamed behind a transaction pooler
//! ([`SqlxStore::transaction_pooling`]).

use std::time::Duration;

use ::sqlx::{
    postgres::{PgArguments, PgRow},
    query::Query,
    Connection as _, Executor as _, PgConnection, PgPool, Postgres, Row as _,
};
use tokio::time::Instant;

use super::{conn::GuardedConnection, error::map_error, SqlxStore};
use crate::{
    protocol::{
        cancel::cancel_backend,
        claim::begin_then_pid,
        driver::{Cancel, Connection, Deciding, Driver, End, Failed, Statement, Step, Waits},
        owner::timed_out,
        sql::{Param, Sql},
        transaction::{BEGIN, COMMIT, ROLLBACK},
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

impl Driver for SqlxStore {
    type Row = PgRow;
    type Conn = GuardedConnection;

    async fn connect(&self) -> Result<GuardedConnection, StoreError> {
        GuardedConnection::acquire(&self.pool, self.transaction_pooling)
            .await
            .map_err(map_error)
    }

    /// Not asked: the claim is sent as one statement.
    async fn learn_citus(&self, _conn: &mut GuardedConnection) -> Option<bool> {
        Some(false)
    }

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

    fn target(&self) -> crate::protocol::telemetry::Target {
        let options = self.pool.connect_options();
        // Over a Unix socket, no server address.
        let tcp = options.get_socket().is_none();
        crate::protocol::telemetry::Target {
            database: options.get_database().map(str::to_owned),
            host: tcp.then(|| options.get_host().to_owned()),
            port: tcp.then(|| options.get_port()),
        }
    }

    async fn transaction(
        &self,
        sql: Sql<'static>,
        params: &[Param<'_>],
        wait: Duration,
    ) -> Result<Vec<PgRow>, StoreError> {
        let ran = async {
            let mut conn = self.connect().await?;
            let waits = Waits {
                lock: Some(wait),
                idle: None,
            };
            match conn.begin(waits, &[Statement { sql, params }]).await {
                Ok(mut rows) => {
                    conn.finish(COMMIT, false).await.map_err(map_error)?;
                    Ok(rows.pop().unwrap_or_default())
                }
                Err(e) => {
                    // Should the rollback fail, the connection is closed.
                    let _ = conn.finish(ROLLBACK, false).await;
                    Err(e)
                }
            }
        };
        // Cut off mid-statement, the connection is dropped and closed, and
        // the server rolls back.
        tokio::time::timeout(wait + GRACE, ran)
            .await
            .unwrap_or_else(|_| Err(timed_out()))
    }
}

impl Connection for GuardedConnection {
    type Row = PgRow;
    type Cancel = SqlxCancel;

    async fn begin(
        &mut self,
        waits: Waits,
        first: &[Statement<'_>],
    ) -> Result<Vec<Vec<PgRow>>, StoreError> {
        self.begin_later(waits).await?;
        let mut rows = Vec::with_capacity(first.len());
        for statement in first {
            rows.push(self.query(statement.sql, statement.params).await?);
        }
        Ok(rows)
    }

    /// `BEGIN`, the waits and the session's process id: one simple-query
    /// message, sent now.
    async fn begin_later(&mut self, waits: Waits) -> Result<(), StoreError> {
        self.mark_dirty();
        let batch = begin_then_pid(waits.lock, waits.idle);
        // A query without arguments goes out as one simple-query message.
        let rows = self
            .raw()
            .fetch_all(::sqlx::AssertSqlSafe(batch))
            .await
            .map_err(map_error)?;
        let row = rows
            .last()
            .ok_or_else(|| StoreError::new(StoreErrorKind::Backend, "beginning returned no row"))?;
        self.set_pid(row.try_get(0).map_err(map_error)?);
        Ok(())
    }

    async fn query(
        &mut self,
        sql: Sql<'static>,
        params: &[Param<'_>],
    ) -> Result<Vec<PgRow>, StoreError> {
        let pooling = self.transaction_pooling();
        query(sql, params, pooling)
            .fetch_all(self.raw())
            .await
            .map_err(map_error)
    }

    async fn batch(&mut self, sql: &str) -> Result<(), StoreError> {
        self.mark_dirty();
        // A string without arguments goes out as a simple query: several
        // statements in one.
        self.raw()
            .execute(::sqlx::AssertSqlSafe(sql.to_owned()))
            .await
            .map(drop)
            .map_err(map_error)
    }

    fn settled(&mut self) {
        self.mark_settled();
    }

    async fn end(mut self, deciding: Option<Deciding<'_>>, end: End) -> Result<(), Failed> {
        let end = match end {
            End::Unused => {
                return self
                    .finish(ROLLBACK, false)
                    .await
                    .map_err(|e| failed(Step::End, e, false));
            }
            End::Rollback => {
                // A statement the handler started may still run on the
                // connection (its future was dropped at the layer's
                // deadline): wait until it ended.
                drain(self.raw())
                    .await
                    .map_err(|e| failed(Step::End, e, false))?;
                ROLLBACK
            }
            End::Commit => COMMIT,
        };
        if let Some(deciding) = deciding {
            let pooling = self.transaction_pooling();
            let decided = query(deciding.sql, deciding.params, pooling)
                .execute(self.raw())
                .await;
            if let Err(e) = decided {
                // Should the rollback fail, the connection is closed, and
                // the server rolls back.
                if let Err(rollback) = self.finish(ROLLBACK, true).await {
                    tracing::debug!(error = %rollback, "rolling back after a failed deciding statement failed");
                }
                return Err(failed(Step::Deciding, e, false));
            }
        }
        self.finish(end, true)
            .await
            .map_err(|e| failed(Step::End, e, end == COMMIT))
    }

    fn canceller(&self) -> SqlxCancel {
        let (pool, pid) = self.cancel_target();
        SqlxCancel { pool, pid }
    }
}

/// The facts of a failed step: a connection that failed (an I/O error, a
/// message out of turn, its worker gone) is lost.
fn failed(step: Step, e: ::sqlx::Error, commit_sent: bool) -> Failed {
    let connection_lost = matches!(
        e,
        ::sqlx::Error::Io(_) | ::sqlx::Error::Protocol(_) | ::sqlx::Error::WorkerCrashed
    );
    Failed {
        step,
        error: map_error(e),
        commit_sent,
        connection_lost,
    }
}

/// Waits until nothing runs on the connection any more. The answer of a
/// statement whose future was dropped may still be on its way: an error in
/// it (a cancelled statement) comes back once, then the connection is idle.
async fn drain(conn: &mut PgConnection) -> Result<(), ::sqlx::Error> {
    match conn.ping().await {
        Err(::sqlx::Error::Database(_)) => conn.ping().await,
        other => other,
    }
}

/// Cancels the statement running in a transaction's session, from another
/// pooled connection (`pg_cancel_backend`).
///
/// Behind a transaction pooler too: the process id was read inside the
/// transaction, which is still open (its `ROLLBACK` waits for the
/// statement), so the pooler still lends this client that server
/// connection. The statement is a simple query (the id is a number of
/// ours, not client data): one round trip, nothing prepared.
#[derive(Clone)]
pub(crate) struct SqlxCancel {
    pool: PgPool,
    pid: Option<i32>,
}

impl Cancel for SqlxCancel {
    async fn cancel(&self) -> Result<(), StoreError> {
        let Some(pid) = self.pid else {
            return Err(StoreError::new(
                StoreErrorKind::Backend,
                "no transaction began on the connection",
            ));
        };
        (&self.pool)
            .execute(::sqlx::AssertSqlSafe(cancel_backend(pid)))
            .await
            .map(drop)
            .map_err(map_error)
    }
}
