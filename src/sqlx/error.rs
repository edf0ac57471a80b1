//! sqlx errors sorted into the store's stable [`StoreErrorKind`]s, by
//! SQLSTATE for the server's errors.

use crate::{
    protocol::errors::kind_of,
    store::{StoreError, StoreErrorKind},
};

/// The SQLSTATE of `e`, if the server answered with an error.
pub(super) fn sql_state(e: &::sqlx::Error) -> Option<String> {
    match e {
        ::sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// Sorts an error of a statement inside the transaction.
pub(super) fn map_error(e: ::sqlx::Error) -> StoreError {
    let code = sql_state(&e);
    let kind = match (&e, code.as_deref()) {
        (::sqlx::Error::Database(_), Some(code)) => kind_of(code),
        (
            ::sqlx::Error::Io(_)
            | ::sqlx::Error::Tls(_)
            | ::sqlx::Error::PoolTimedOut
            | ::sqlx::Error::PoolClosed
            | ::sqlx::Error::WorkerCrashed,
            _,
        ) => StoreErrorKind::Unavailable,
        (::sqlx::Error::ColumnDecode { .. } | ::sqlx::Error::Decode(_), _) => {
            StoreErrorKind::Corrupt
        }
        _ => StoreErrorKind::Backend,
    };
    // The server's message names the failure without row values (those are
    // in the detail, which stays out of the message).
    let message = match &e {
        ::sqlx::Error::Database(db) => format!(
            "database error {}: {}",
            code.as_deref().unwrap_or("?"),
            db.message()
        ),
        ::sqlx::Error::PoolTimedOut => "no connection from the pool in time".to_owned(),
        ::sqlx::Error::Io(_) | ::sqlx::Error::WorkerCrashed => {
            "the database connection failed".to_owned()
        }
        _ => "the database driver failed".to_owned(),
    };
    StoreError::new(kind, message)
        .with_sql_state(code)
        .with_source(e)
}

/// A statement's error as the store sorts it, so that a
/// [`SqlxTx`](super::SqlxTx) handler can `?` its queries into a
/// `Result<_, StoreError>` (an answer with the `axum` feature, see
/// [`StoreError::to_problem`]).
impl From<::sqlx::Error> for StoreError {
    fn from(e: ::sqlx::Error) -> Self {
        map_error(e)
    }
}
