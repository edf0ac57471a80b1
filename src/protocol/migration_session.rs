//! What the migration runner and Citus's distribution share: the
//! [`MigrationSession`] their statements go through (one connection of a
//! [`Driver`], [`OnConnection`]), the statements on
//! the migration table it runs for them, and the [`MIGRATION_LOCK`] both
//! take. The runner (`migrations`) and `citus` each depend on this module,
//! and the runner on `citus`, never the other way.

use std::future::Future;

use super::{
    driver::{Connection, Driver},
    errors::LOCK_NOT_AVAILABLE,
    sql::{Columns, Param, Sql},
};
use crate::store::StoreError;

/// Serialises concurrent migrators (any constant unique to this crate).
pub(crate) const MIGRATION_LOCK: i64 = 0x7469_6465_6d70_0001;

/// What [`MigrationSession::applied`] runs: every recorded `(version, name)`.
pub(crate) const APPLIED: Sql<'static> =
    Sql::new("SELECT version, name FROM tower_idempotency_migrations");

/// What [`MigrationSession::record`] runs, with the version and the name.
pub(crate) const RECORD: Sql<'static> = Sql::new(
    "INSERT INTO tower_idempotency_migrations (version, name) VALUES ($1::int4, $2::text)",
);

/// What [`MigrationSession::index_valid`] runs, with the index's name: one row,
/// whether the index is valid, or none if there is no such index.
pub(crate) const INDEX_VALID: Sql<'static> =
    Sql::new("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1::text)");

/// How the runner's statements are sent, all on one connection
/// ([`OnConnection`]; a test may stand in another).
///
/// Methods return `impl Future + Send`; implementations may write
/// `async fn`. Every statement the runner sends with parameters runs inside
/// a transaction it began (so a transaction pooler keeps it on one server
/// connection); only [`batch`](Self::batch) runs outside one.
pub(crate) trait MigrationSession: Send {
    /// Sends `sql`, one or more statements without parameters, as one
    /// simple-query message.
    fn batch(&mut self, sql: &str) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// A row of this driver.
    type Row: Columns + Send;

    /// Runs `sql` with `params` and returns its rows.
    fn query(
        &mut self,
        sql: Sql<'static>,
        params: &[Param<'_>],
    ) -> impl Future<Output = Result<Vec<Self::Row>, StoreError>> + Send;

    /// Runs [`APPLIED`].
    fn applied(&mut self) -> impl Future<Output = Result<Vec<(i32, String)>, StoreError>> + Send {
        async {
            let rows = self.query(APPLIED, &[]).await?;
            rows.iter()
                .map(|row| Ok((row.int4(0)?, row.text(1)?.to_owned())))
                .collect()
        }
    }

    /// Runs [`RECORD`].
    fn record(
        &mut self,
        version: i32,
        name: &'static str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        async move {
            let params = [Param::Int4(version), Param::Text(name)];
            self.query(RECORD, &params).await.map(drop)
        }
    }

    /// Runs [`INDEX_VALID`].
    fn index_valid(
        &mut self,
        name: &'static str,
    ) -> impl Future<Output = Result<Option<bool>, StoreError>> + Send {
        async move {
            let rows = self.query(INDEX_VALID, &[Param::Text(name)]).await?;
            rows.first().map(|row| row.bool(0)).transpose()
        }
    }

    /// Commits the transaction the runner began.
    fn commit(&mut self) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.batch(super::transaction::COMMIT)
    }

    /// Whether `error` is a lock wait that ran out (`55P03`): the
    /// transaction is rolled back and tried again.
    fn lock_timed_out(error: &StoreError) -> bool {
        error.sql_state() == Some(LOCK_NOT_AVAILABLE)
    }
}

/// One pooled connection of a [`Driver`] as the runner's session. It goes
/// back to the pool only once the run ended with its `COMMIT` and asked for
/// no new sessions ([`finish`](Self::finish)); otherwise it is closed, and
/// the server rolls back whatever transaction it was in.
pub(crate) struct OnConnection<C> {
    conn: C,
    /// The last message sent was an acknowledged `COMMIT`.
    committed: bool,
}

impl<C: Connection> OnConnection<C> {
    /// A connection of `driver`'s pool.
    pub(crate) async fn open<D: Driver<Conn = C>>(driver: &D) -> Result<Self, StoreError> {
        Ok(OnConnection {
            conn: driver.connect().await?,
            committed: false,
        })
    }

    /// The run is over: pooled again if it ended with its `COMMIT` and
    /// sessions need not start anew (`reconnect`: it changed a default that
    /// sessions read when they start), else closed.
    pub(crate) fn finish(mut self, reconnect: bool) {
        if self.committed && !reconnect {
            self.conn.settled();
        }
    }
}

impl<C: Connection> MigrationSession for OnConnection<C> {
    type Row = C::Row;

    async fn batch(&mut self, sql: &str) -> Result<(), StoreError> {
        self.committed = false;
        self.conn.batch(sql).await
    }

    async fn query(
        &mut self,
        sql: Sql<'static>,
        params: &[Param<'_>],
    ) -> Result<Vec<C::Row>, StoreError> {
        self.committed = false;
        self.conn.query(sql, params).await
    }

    async fn commit(&mut self) -> Result<(), StoreError> {
        self.batch(super::transaction::COMMIT).await?;
        self.committed = true;
        Ok(())
    }
}
