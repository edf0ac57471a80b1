//! [`TxError`]: what a statement through [`PgTx`](super::PgTx) can fail
//! with, and the guard that refuses statements before they are sent.

use std::fmt;

use tokio_postgres::error::SqlState;

use crate::protocol::lexer::{self, Refusal};

/// Statements that would end the layer's transaction or change the session.
pub(super) fn refuse_transaction_control(sql: &str) -> Result<(), TxError> {
    match lexer::refusal(sql) {
        None => Ok(()),
        Some(refusal) => Err(TxError {
            kind: match refusal {
                Refusal::TransactionControl => TxErrorKind::TransactionControl,
                Refusal::SessionState => TxErrorKind::SessionState,
            },
            source: None,
        }),
    }
}

/// What went wrong with a statement run through [`PgTx`](super::PgTx).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TxErrorKind {
    /// The layer already committed or rolled the transaction back (e.g. a
    /// spawned task wrote after the handler returned).
    Finished,
    /// The statement would begin, commit or roll back the transaction, which
    /// only the layer may do; or the guard could not read the SQL text with
    /// certainty (an unterminated quote or comment, a control character
    /// outside a string), and refuses rather than guesses.
    TransactionControl,
    /// The statement would change the session beyond this request, on a
    /// connection other requests reuse: a `SET` without `LOCAL`, `RESET`,
    /// prepared statements, `LISTEN`, temporary objects, `WITH HOLD` cursors,
    /// `set_config(…, false)`, writes to `pg_settings`, a `pg_temp` search
    /// path, session advisory locks (see the [transaction
    /// guide](crate::guide::transaction)).
    SessionState,
    /// PostgreSQL answered with an error; see [`TxError::code`].
    Database,
    /// A long-running operation's fenced transaction was refused (or its
    /// commit was): another owner took the operation over with a larger
    /// token. Nothing was written; stop the work.
    Fenced,
    /// The store could not open or commit a fenced transaction (see
    /// [`TxError::store_error`]).
    Store,
}

/// An error from a statement run through [`PgTx`](super::PgTx).
#[derive(Debug)]
pub struct TxError {
    kind: TxErrorKind,
    source: Option<Source>,
}

#[derive(Debug)]
enum Source {
    Postgres(tokio_postgres::Error),
    Store(crate::store::StoreError),
}

impl TxError {
    pub(super) fn finished() -> Self {
        TxError {
            kind: TxErrorKind::Finished,
            source: None,
        }
    }

    /// The connection is gone (closed, reset, or its server process
    /// terminated): nothing sent on it can still commit.
    pub(super) fn lost_connection(&self) -> bool {
        let Some(Source::Postgres(e)) = &self.source else {
            return false;
        };
        match e.as_db_error() {
            // admin_shutdown, crash_shutdown, cannot_connect_now: the server
            // ended the session.
            Some(db) => crate::protocol::errors::ended_the_session(db.code().code()),
            None => {
                e.is_closed()
                    || std::error::Error::source(e).is_some_and(|s| s.is::<std::io::Error>())
            }
        }
    }

    /// The server knows no prepared statement of the name the driver used
    /// (`26000`), or has one of the name it meant to create (`42P05`).
    pub(super) fn names_a_missing_statement(&self) -> bool {
        self.code()
            .is_some_and(|code| crate::protocol::errors::names_a_missing_statement(code.code()))
    }

    /// The answer for a handler that gives up on this error: `503
    /// store_unavailable` with `Retry-After` when the database is gone or
    /// unavailable (the connection lost, the server shutting down, too many
    /// connections, a statement cancelled by a timeout) or the transaction
    /// lost to a concurrent one (a serialization failure, a deadlock); `503
    /// operation_taken_over` when a long-running attempt was fenced; `500
    /// statement_failed` for a statement the database or the handle refused
    /// (a constraint, a missing table, transaction control) or a handle that
    /// had already finished. SQLSTATEs are sorted by the table both stores
    /// share, so `SqlxTx` handlers get the same answers
    /// ([`StoreError::to_problem`](crate::store::StoreError::to_problem)).
    ///
    /// The body names neither the statement nor the database's message
    /// (which may quote the request's values); the layer rolls the handler's
    /// work back, as for any 5xx. A failure the client can act on (a unique
    /// violation meaning "already exists") deserves an answer of its own:
    /// match [`code`](Self::code) before giving up.
    ///
    /// With the `axum` feature `TxError` is an `IntoResponse` built from
    /// this, so a handler returns `Result<_, TxError>` and uses `?`.
    pub fn to_problem(&self) -> crate::problem::Problem {
        crate::problem::statement_failed(self.store_kind())
    }

    /// The failure sorted as the stores sort theirs.
    fn store_kind(&self) -> crate::store::StoreErrorKind {
        use crate::store::StoreErrorKind as Kind;
        match self.kind {
            TxErrorKind::Finished => Kind::TransactionAborted,
            TxErrorKind::TransactionControl | TxErrorKind::SessionState => Kind::Backend,
            TxErrorKind::Fenced => Kind::Fenced,
            TxErrorKind::Store => self.store_error().map_or(Kind::Backend, |e| e.kind()),
            TxErrorKind::Database => match self.code() {
                Some(code) => crate::protocol::errors::kind_of(code.code()),
                None if self.lost_connection() => Kind::Unavailable,
                // The driver refused before sending (a parameter that does
                // not convert, a wrong count): the same request fails again.
                None => Kind::Backend,
            },
        }
    }

    /// The category.
    pub fn kind(&self) -> TxErrorKind {
        self.kind
    }

    /// The SQLSTATE, when PostgreSQL answered with an error
    /// (e.g. [`SqlState::UNIQUE_VIOLATION`]).
    pub fn code(&self) -> Option<&SqlState> {
        self.as_postgres().and_then(|e| e.code())
    }

    /// The underlying driver error.
    pub fn as_postgres(&self) -> Option<&tokio_postgres::Error> {
        match &self.source {
            Some(Source::Postgres(e)) => Some(e),
            _ => None,
        }
    }

    /// The store's error, for [`TxErrorKind::Store`] and [`TxErrorKind::Fenced`].
    pub fn store_error(&self) -> Option<&crate::store::StoreError> {
        match &self.source {
            Some(Source::Store(e)) => Some(e),
            _ => None,
        }
    }
}

impl From<tokio_postgres::Error> for TxError {
    fn from(e: tokio_postgres::Error) -> Self {
        TxError {
            kind: TxErrorKind::Database,
            source: Some(Source::Postgres(e)),
        }
    }
}

impl From<crate::store::StoreError> for TxError {
    fn from(e: crate::store::StoreError) -> Self {
        let kind = match e.kind() {
            crate::store::StoreErrorKind::Fenced => TxErrorKind::Fenced,
            _ => TxErrorKind::Store,
        };
        TxError {
            kind,
            source: Some(Source::Store(e)),
        }
    }
}

impl fmt::Display for TxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.kind, &self.source) {
            (TxErrorKind::Finished, _) => f.write_str("the idempotency transaction has already finished"),
            (TxErrorKind::TransactionControl, _) => f.write_str(
                "transaction control statements (and SQL text the guard cannot read with certainty) are reserved for the idempotency layer; savepoints are allowed",
            ),
            (TxErrorKind::SessionState, _) => f.write_str(
                "the statement would change the pooled session beyond this request; use SET LOCAL, pg_advisory_xact_lock or transaction-scoped objects",
            ),
            (TxErrorKind::Fenced, _) => f.write_str(
                "fenced: another owner took the operation over with a larger attempt token; nothing was written",
            ),
            (_, Some(Source::Store(e))) => write!(f, "store error: {e}"),
            // The driver's own text for a server error is only "db error".
            (_, Some(Source::Postgres(e))) => match e.as_db_error() {
                Some(db) => write!(f, "database error {}: {}", db.code().code(), db.message()),
                None => write!(f, "database error: {e}"),
            },
            (_, None) => f.write_str("database error"),
        }
    }
}

/// [`TxError::to_problem`]: `503 store_unavailable` (with `Retry-After`)
/// when the database is lost or unavailable, `500 statement_failed` for a
/// statement it refused. The body names neither the statement nor the
/// database's message; the failure is logged at debug by kind and SQLSTATE
/// only (inside the layer's span, which carries the key hashed). A 5xx
/// answer rolls the handler's work back.
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(all(feature = "axum", feature = "postgres"))))]
impl axum_core::response::IntoResponse for TxError {
    fn into_response(self) -> axum_core::response::Response {
        // Not the error's text: the server's message may quote the
        // request's values.
        tracing::debug!(
            kind = ?self.kind(),
            sqlstate = self.code().map(|c| c.code()),
            "the handler answered a failed statement"
        );
        axum_core::response::IntoResponse::into_response(self.to_problem())
    }
}

impl std::error::Error for TxError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.source {
            Some(Source::Postgres(e)) => Some(e),
            Some(Source::Store(e)) => Some(e),
            None => None,
        }
    }
}
