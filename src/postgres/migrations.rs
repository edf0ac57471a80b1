//! The migration runner's [`Transport`] on a [`Session`]; the runner and the
//! migrations are in `crate::protocol::migrations`.

use tokio_postgres::types::Type;

use super::{
    session::{Committed, Session},
    statements::Sql,
};
use crate::protocol::migrations::{self, Transport, APPLIED, INDEX_VALID, RECORD};
use crate::store::{StoreError, StoreErrorKind};

const APPLIED_SQL: Sql<'static> = Sql::new(APPLIED, &[]);

pub(super) const RECORD_SQL: Sql<'static> = Sql::new(RECORD, &[Type::INT4, Type::TEXT]);

const INDEX_VALID_SQL: Sql<'static> = Sql::new(INDEX_VALID, &[Type::TEXT]);

/// Applies what is missing; the caller marks `session` dirty first and
/// clean with the returned [`Committed`], the proof of the run's last
/// `COMMIT`. On error the session stays dirty and is closed, which rolls
/// back whatever transaction it was in.
pub(super) async fn run(session: &Session) -> Result<Committed, StoreError> {
    let mut transport = SessionTransport::new(session);
    migrations::run(&mut transport).await?;
    transport.committed()
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
    session.mark_dirty();
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

impl Transport for SessionTransport<'_> {
    async fn batch(&mut self, sql: &str) -> Result<(), StoreError> {
        self.committed = None;
        self.session.batch_execute(sql).await
    }

    async fn applied(&mut self) -> Result<Vec<(i32, String)>, StoreError> {
        let rows = self.session.query(APPLIED_SQL, &[]).await?;
        Ok(rows.iter().map(|row| (row.get(0), row.get(1))).collect())
    }

    async fn record(&mut self, version: i32, name: &'static str) -> Result<(), StoreError> {
        self.session
            .execute(RECORD_SQL, &[&version, &name])
            .await
            .map(drop)
    }

    async fn index_valid(&mut self, name: &'static str) -> Result<Option<bool>, StoreError> {
        let row = self.session.query_opt(INDEX_VALID_SQL, &[&name]).await?;
        Ok(row.map(|row| row.get(0)))
    }

    async fn commit(&mut self) -> Result<(), StoreError> {
        self.committed = Some(self.session.commit().await?);
        Ok(())
    }
}
