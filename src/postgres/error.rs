//! Driver errors sorted into the store's stable [`StoreErrorKind`]s.

use crate::{
    protocol::errors::kind_of,
    store::{StoreError, StoreErrorKind},
};

/// Sorts driver errors into the store's stable kinds.
pub(super) fn map_error(e: tokio_postgres::Error) -> StoreError {
    let kind = match e.code() {
        // Not a server error: the connection failed, or a value could not be
        // encoded (nothing was sent, and sending it again fails the same way).
        None if is_encoding_error(&e) => StoreErrorKind::Backend,
        None => StoreErrorKind::Unavailable,
        Some(code) => kind_of(code.code()),
    };
    let code = e.code().map(|c| c.code().to_owned());
    // The server's message names the failure without row values (those are
    // in the detail, which stays out of logs).
    let message = match e.as_db_error() {
        Some(db) => format!("database error {}: {}", db.code().code(), db.message()),
        None if e.is_closed() => "the database connection is closed".to_owned(),
        None => "cannot talk to the database".to_owned(),
    };
    StoreError::new(kind, message)
        .with_sql_state(code)
        .with_source(e)
}

/// The driver fails to serialize a parameter before anything is sent.
fn is_encoding_error(e: &tokio_postgres::Error) -> bool {
    use std::error::Error as _;
    // tokio-postgres has no public kind for it; its message is stable.
    !e.is_closed() && e.source().is_some() && e.to_string().starts_with("error serializing")
}
