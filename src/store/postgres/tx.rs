//! [`PgTx`]: the open transaction a key's owner writes through.

use std::{fmt, sync::Arc};

use deadpool_postgres::Object;
use tokio::sync::Mutex;
use tokio_postgres::{error::SqlState, types::ToSql, Row};

use crate::scope::Scope;

/// The open PostgreSQL transaction of the request that owns its key.
///
/// The layer puts it into the request extensions before calling the handler
/// (with the `axum` feature it is also an extractor). Everything written
/// through it commits in the same transaction as the remembered response,
/// before the response is sent, or not at all.
///
/// `PgTx` is `Clone + Send + Sync + 'static`; clones share one connection, and
/// statements run one at a time. It cannot leak a half-open transaction: when
/// the layer finishes, the transaction is committed or rolled back and every
/// later call answers [`TxErrorKind::Finished`]; if the layer never gets to
/// finish it (a panic, a dropped task), the last handle to go closes the
/// connection instead of returning it to the pool, and PostgreSQL rolls back.
///
/// Never issue `BEGIN`, `COMMIT` or `ROLLBACK` yourself: the layer owns the
/// transaction's end, and such statements are refused with
/// [`TxErrorKind::TransactionControl`]. Savepoints are fine.
///
/// ```no_run
/// # async fn handler(tx: tower_idempotency::PgTx) -> Result<(), tower_idempotency::TxError> {
/// let row = tx
///     .query_one(
///         "INSERT INTO orders (tenant_id, total) VALUES ($1, $2) RETURNING id",
///         &[&tx.tenant(), &2400_i64],
///     )
///     .await?;
/// let id: i64 = row.get(0);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgTx {
    inner: Arc<Shared>,
}

struct Shared {
    conn: Mutex<Option<Object>>,
    scope: Scope,
    key: crate::IdempotencyKey,
    token: i64,
}

impl PgTx {
    pub(super) fn new(conn: Object, scope: Scope, key: crate::IdempotencyKey, token: i64) -> Self {
        PgTx {
            inner: Arc::new(Shared {
                conn: Mutex::new(Some(conn)),
                scope,
                key,
                token,
            }),
        }
    }

    /// The tenant the request acts for, as a string (handy as a query parameter).
    pub fn tenant(&self) -> &str {
        self.inner.scope.tenant().as_str()
    }

    /// The scope (tenant and endpoint) of the owned key.
    pub fn scope(&self) -> &Scope {
        &self.inner.scope
    }

    /// The attempt number of this operation under its key: 1 for the first,
    /// higher after an expired key was taken over.
    pub fn attempt_token(&self) -> i64 {
        self.inner.token
    }

    pub(super) fn key(&self) -> &crate::IdempotencyKey {
        &self.inner.key
    }

    /// Runs one statement and returns the number of rows it affected.
    pub async fn execute(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<u64, TxError> {
        refuse_transaction_control(sql)?;
        let conn = self.inner.conn.lock().await;
        let conn = conn.as_ref().ok_or_else(TxError::finished)?;
        let statement = conn.prepare_cached(sql).await?;
        Ok(conn.execute(&statement, params).await?)
    }

    /// Runs one query and returns its rows.
    pub async fn query(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, TxError> {
        refuse_transaction_control(sql)?;
        let conn = self.inner.conn.lock().await;
        let conn = conn.as_ref().ok_or_else(TxError::finished)?;
        let statement = conn.prepare_cached(sql).await?;
        Ok(conn.query(&statement, params).await?)
    }

    /// Runs a query that returns exactly one row.
    pub async fn query_one(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, TxError> {
        refuse_transaction_control(sql)?;
        let conn = self.inner.conn.lock().await;
        let conn = conn.as_ref().ok_or_else(TxError::finished)?;
        let statement = conn.prepare_cached(sql).await?;
        Ok(conn.query_one(&statement, params).await?)
    }

    /// Runs a query that returns at most one row.
    pub async fn query_opt(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, TxError> {
        refuse_transaction_control(sql)?;
        let conn = self.inner.conn.lock().await;
        let conn = conn.as_ref().ok_or_else(TxError::finished)?;
        let statement = conn.prepare_cached(sql).await?;
        Ok(conn.query_opt(&statement, params).await?)
    }

    /// Runs statements without parameters (e.g. `SAVEPOINT s1`).
    pub async fn batch_execute(&self, sql: &str) -> Result<(), TxError> {
        for statement in sql.split(';') {
            refuse_transaction_control(statement)?;
        }
        let conn = self.inner.conn.lock().await;
        let conn = conn.as_ref().ok_or_else(TxError::finished)?;
        Ok(conn.batch_execute(sql).await?)
    }

    /// Takes the connection out to end the transaction; `None` if it already ended.
    pub(super) async fn take(&self) -> Option<Object> {
        self.inner.conn.lock().await.take()
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.get_mut().take() {
            // The transaction never reached commit or rollback. Detach the
            // connection from the pool and close it: PostgreSQL rolls back.
            tracing::warn!(
                endpoint = self.scope.endpoint(),
                key_hash = %self.key.short_hash(),
                "idempotency transaction dropped unfinished; closing its connection (rolled back)"
            );
            drop(Object::take(conn));
        }
    }
}

impl fmt::Debug for PgTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTx")
            .field("scope", &self.inner.scope)
            .field("key", &self.inner.key)
            .field("attempt_token", &self.inner.token)
            .finish_non_exhaustive()
    }
}

/// Statements that would end or restart the layer's transaction.
fn refuse_transaction_control(sql: &str) -> Result<(), TxError> {
    let mut words = sql
        .split(|c: char| c.is_whitespace() || c == '(')
        .filter(|w| !w.is_empty())
        .map(str::to_ascii_uppercase);
    let first = words.next().unwrap_or_default();
    let refused = match first.as_str() {
        "BEGIN" | "START" | "COMMIT" | "END" | "ABORT" => true,
        // ROLLBACK TO SAVEPOINT is allowed; a plain ROLLBACK is not.
        "ROLLBACK" => !matches!(words.next().as_deref(), Some("TO")),
        "PREPARE" => matches!(words.next().as_deref(), Some("TRANSACTION")),
        _ => false,
    };
    if refused {
        Err(TxError {
            kind: TxErrorKind::TransactionControl,
            source: None,
        })
    } else {
        Ok(())
    }
}

/// What went wrong with a statement run through [`PgTx`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TxErrorKind {
    /// The layer already committed or rolled the transaction back (e.g. a
    /// spawned task wrote after the handler returned).
    Finished,
    /// The statement would begin, commit or roll back the transaction, which
    /// only the layer may do.
    TransactionControl,
    /// PostgreSQL answered with an error; see [`TxError::code`].
    Database,
}

/// An error from a statement run through [`PgTx`].
#[derive(Debug)]
pub struct TxError {
    kind: TxErrorKind,
    source: Option<tokio_postgres::Error>,
}

impl TxError {
    fn finished() -> Self {
        TxError {
            kind: TxErrorKind::Finished,
            source: None,
        }
    }

    /// The category.
    pub fn kind(&self) -> TxErrorKind {
        self.kind
    }

    /// The SQLSTATE, when PostgreSQL answered with an error
    /// (e.g. [`SqlState::UNIQUE_VIOLATION`]).
    pub fn code(&self) -> Option<&SqlState> {
        self.source.as_ref().and_then(|e| e.code())
    }

    /// The underlying driver error.
    pub fn as_postgres(&self) -> Option<&tokio_postgres::Error> {
        self.source.as_ref()
    }
}

impl From<tokio_postgres::Error> for TxError {
    fn from(e: tokio_postgres::Error) -> Self {
        TxError {
            kind: TxErrorKind::Database,
            source: Some(e),
        }
    }
}

impl fmt::Display for TxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.kind, &self.source) {
            (TxErrorKind::Finished, _) => f.write_str("the idempotency transaction has already finished"),
            (TxErrorKind::TransactionControl, _) => f.write_str(
                "transaction control statements are reserved for the idempotency layer (savepoints are allowed)",
            ),
            (_, Some(e)) => write!(f, "database error: {e}"),
            (_, None) => f.write_str("database error"),
        }
    }
}

impl std::error::Error for TxError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_ref().map(|e| e as _)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_only_statements_that_end_the_transaction() {
        for sql in [
            "COMMIT",
            "  commit;",
            "BEGIN",
            "start transaction",
            "rollback",
            "END",
            "abort",
            "PREPARE TRANSACTION 'x'",
        ] {
            assert!(refuse_transaction_control(sql).is_err(), "{sql}");
        }
        for sql in [
            "SAVEPOINT a",
            "ROLLBACK TO SAVEPOINT a",
            "rollback to a",
            "RELEASE a",
            "INSERT INTO t VALUES (1)",
            "PREPARE q AS SELECT 1",
            "",
            "select 'COMMIT'",
        ] {
            assert!(refuse_transaction_control(sql).is_ok(), "{sql}");
        }
    }
}
