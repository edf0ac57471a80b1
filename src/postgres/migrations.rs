//! The migration runner's [`MigrationSession`] on a [`Session`]; the runner and the
//! migrations are in `crate::protocol::migrations`.

use tokio_postgres::Row;

use super::{
    prepared::dyn_params,
    session::{Committed, Session},
};
use crate::protocol::{
    citus,
    migration_session::MigrationSession,
    migrations,
    sql::{Param, Sql},
};
use crate::store::{StoreError, StoreErrorKind};

/// Applies what is missing; the caller marks `session` dirty first and
/// clean with the returned [`Committed`], the proof of the run's last
/// `COMMIT`. On error the session stays dirty and is closed, which rolls
/// back whatever transaction it was in.
/// The `COMMIT` is `None` when the session must be closed rather than
/// pooled again (the run changed a default that sessions read when they
/// start); the flag says whether the database is a Citus coordinator.
pub(super) async fn run(session: &Session) -> Result<(Option<Committed>, bool), StoreError> {
    let mut transport = SessionTransport::new(session);
    let summary = migrations::run(&mut transport).await?;
    let committed = transport.committed()?;
    Ok(((!summary.reconnect).then_some(committed), summary.citus))
}

/// [`citus::distribute`] of `tables`, as [`run`] is run.
/// The session's `COMMIT` comes back `None` as [`run`]'s does.
pub(super) async fn distribute(
    session: &Session,
    tables: &[&str],
) -> Result<(Option<Committed>, bool), StoreError> {
    let mut transport = SessionTransport::new(session);
    let done = citus::distribute(&mut transport, tables).await?;
    let committed = transport.committed()?;
    Ok(((!done.reconnect).then_some(committed), done.citus))
}

/// [`run`] on a session of `store`, with a list and settings of the
/// caller's.
#[cfg(test)]
pub(crate) async fn run_on(
    store: &super::PgStore,
    list: &[migrations::Migration],
    settings: &migrations::Settings,
) -> Result<migrations::Summary, StoreError> {
    let mut session = store.session().await?;
    let mut transport = SessionTransport::new(&session);
    let summary = migrations::run_list(&mut transport, list, settings).await?;
    let committed = transport.committed()?;
    session.mark_clean(committed);
    Ok(summary)
}

/// A [`Session`] as the runner's transport.
struct SessionTransport<'a> {
    session: &'a Session,
    /// The proof of the last statement's `COMMIT`, if the last statement was
    /// one.
    committed: Option<Committed>,
}

impl<'a> SessionTransport<'a> {
    fn new(session: &'a Session) -> Self {
        SessionTransport {
            session,
            committed: None,
        }
    }

    /// The proof that the session is outside any transaction: every
    /// transaction of a run that succeeded ended with its `COMMIT`.
    fn committed(self) -> Result<Committed, StoreError> {
        self.committed.ok_or_else(|| {
            StoreError::new(
                StoreErrorKind::Backend,
                "the migration run did not end with a commit",
            )
        })
    }
}

impl MigrationSession for SessionTransport<'_> {
    type Row = Row;

    async fn batch(&mut self, sql: &str) -> Result<(), StoreError> {
        self.committed = None;
        self.session.batch_execute(sql).await
    }

    async fn query(
        &mut self,
        sql: Sql<'static>,
        params: &[Param<'_>],
    ) -> Result<Vec<Row>, StoreError> {
        self.session.query(sql, &dyn_params(params)).await
    }

    async fn commit(&mut self) -> Result<(), StoreError> {
        self.committed = Some(self.session.commit().await?);
        Ok(())
    }
}
