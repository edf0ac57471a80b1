//! The migration runner's [`MigrationSession`] on one of the pool's connections;
//! the runner and the migrations are in `crate::protocol::migrations`.

use ::sqlx::{pool::PoolConnection, postgres::PgRow, Executor as _, PgPool, Postgres};

use super::{driver::query, error::map_error};
use crate::{
    protocol::{
        citus,
        migration_session::MigrationSession,
        migrations,
        sql::{Param, Sql},
    },
    store::StoreError,
};

/// Applies what is missing, on one connection of `pool`.
pub(super) async fn run(pool: &PgPool, transaction_pooling: bool) -> Result<(), StoreError> {
    let mut transport = ConnTransport::acquire(pool, transaction_pooling).await?;
    let summary = migrations::run(&mut transport).await?;
    // Otherwise closed: sessions from here on read the new default.
    if !summary.reconnect {
        transport.succeeded();
    }
    Ok(())
}

/// [`citus::distribute`] of `tables`, on one connection of `pool`.
pub(super) async fn distribute(
    pool: &PgPool,
    transaction_pooling: bool,
    tables: &[&str],
) -> Result<bool, StoreError> {
    let mut transport = ConnTransport::acquire(pool, transaction_pooling).await?;
    let done = citus::distribute(&mut transport, tables).await?;
    if !done.reconnect {
        transport.succeeded();
    }
    Ok(done.citus)
}

/// [`run`] with a list and settings of the caller's.
#[cfg(test)]
pub(crate) async fn run_with(
    pool: &PgPool,
    transaction_pooling: bool,
    list: &[migrations::Migration],
    settings: &migrations::Settings,
) -> Result<migrations::Summary, StoreError> {
    let mut transport = ConnTransport::acquire(pool, transaction_pooling).await?;
    let summary = migrations::run_list(&mut transport, list, settings).await?;
    transport.succeeded();
    Ok(summary)
}

/// A pooled connection as the runner's transport; closed rather than
/// pooled again unless the run succeeded.
struct ConnTransport {
    conn: PoolConnection<Postgres>,
    /// Statements go out unnamed (see `SqlxStore::transaction_pooling`).
    transaction_pooling: bool,
    clean: bool,
}

impl ConnTransport {
    async fn acquire(pool: &PgPool, transaction_pooling: bool) -> Result<Self, StoreError> {
        Ok(ConnTransport {
            conn: pool.acquire().await.map_err(map_error)?,
            transaction_pooling,
            clean: false,
        })
    }

    /// The run succeeded: every transaction of it ended with its `COMMIT`,
    /// so the connection may serve again.
    fn succeeded(mut self) {
        self.clean = true;
    }
}

impl Drop for ConnTransport {
    fn drop(&mut self) {
        if !self.clean {
            // Possibly inside a transaction: the server rolls it back.
            self.conn.close_on_drop();
        }
    }
}

impl MigrationSession for ConnTransport {
    type Row = PgRow;

    async fn batch(&mut self, sql: &str) -> Result<(), StoreError> {
        // A string without arguments goes out as a simple query: several
        // statements in one.
        (&mut *self.conn)
            .execute(::sqlx::AssertSqlSafe(sql))
            .await
            .map(drop)
            .map_err(map_error)
    }

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
