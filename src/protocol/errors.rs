//! How both drivers sort the server's errors: one table of SQLSTATEs, so
//! that the same failure is the same [`StoreErrorKind`] (and the same HTTP
//! answer) whichever driver met it.

use crate::store::{StoreError, StoreErrorKind};

/// The SQLSTATE of a lock wait that ran out (`lock_timeout`).
pub(crate) const LOCK_NOT_AVAILABLE: &str = "55P03";

/// Whether an error with SQLSTATE `code` ended only its statement (a lock
/// wait or a statement that ran out), leaving the session sound: roll back
/// and pool the connection again. Every other [`StoreErrorKind::Unavailable`]
/// error means the connection or the server is going away.
pub(crate) fn ends_only_the_statement(code: &str) -> bool {
    matches!(code, LOCK_NOT_AVAILABLE | "57014")
}

/// Whether `e` says the connection itself is at fault (closed by the
/// server, or its session not what the store left), not only the
/// statement: another connection may well succeed.
pub(crate) fn connection_fault(e: &StoreError) -> bool {
    (e.kind() == StoreErrorKind::Unavailable && !e.sql_state().is_some_and(ends_only_the_statement))
        || is_session_fault(e)
}

/// Errors that say this connection's session is not what the store left
/// (its prepared statements deallocated, its `search_path` or role changed,
/// a transaction left open on it, a table changed under a cached plan):
/// another connection is fine.
fn is_session_fault(error: &StoreError) -> bool {
    const CODES: [&str; 8] = [
        "26000", // invalid_sql_statement_name: a cached statement is gone
        "42P05", // duplicate_prepared_statement: a name the driver uses is taken
        "25P02", // in_failed_sql_transaction
        "25001", // active_sql_transaction
        "42P01", // undefined_table: search_path changed
        "3F000", // invalid_schema_name
        "42501", // insufficient_privilege: role changed
        "0A000", // feature_not_supported: cached plan must not change result type
    ];
    error.sql_state().is_some_and(|code| CODES.contains(&code))
}

/// Whether SQLSTATE `code` says the server ended the session
/// (`admin_shutdown`, `crash_shutdown`, `cannot_connect_now`): nothing sent
/// on it can still commit.
pub(crate) fn ended_the_session(code: &str) -> bool {
    code.starts_with("57P")
}

/// Whether SQLSTATE `code` says the server knows no prepared statement of
/// the name the driver used (`26000`), or has one of the name it meant to
/// create (`42P05`): behind a transaction pooler, the driver's statement
/// names reached another server connection.
pub(crate) fn names_a_missing_statement(code: &str) -> bool {
    matches!(code, "26000" | "42P05")
}

/// Whether SQLSTATE `code` is `in_failed_sql_transaction`: the session is
/// inside a transaction that failed.
pub(crate) fn in_failed_transaction(code: &str) -> bool {
    code == "25P02"
}

/// Whether `e` is the connection failing (closed, broken), as a driver
/// reports it: unavailable with no answer from the server.
pub(crate) fn connection_lost(e: &StoreError) -> bool {
    e.kind() == StoreErrorKind::Unavailable && e.sql_state().is_none()
}

/// The kind of a server error with SQLSTATE `code`.
pub(crate) fn kind_of(code: &str) -> StoreErrorKind {
    match code {
        // No such table or column: the schema is not migrated.
        "42P01" | "42703" => StoreErrorKind::Schema,
        // Serialization failure, deadlock: the same work may succeed again.
        "40001" | "40P01" => StoreErrorKind::Conflict,
        // In a failed transaction; division by zero (the completion's
        // ownership check); any integrity constraint.
        "25P02" | "22012" => StoreErrorKind::TransactionAborted,
        c if c.starts_with("23") => StoreErrorKind::TransactionAborted,
        // The connection failed; the server is shutting down or restarting.
        c if c.starts_with("08") || c.starts_with("57P") => StoreErrorKind::Unavailable,
        // Too many connections; statement or lock wait cancelled.
        "53300" | "57014" | LOCK_NOT_AVAILABLE => StoreErrorKind::Unavailable,
        _ => StoreErrorKind::Backend,
    }
}

/// A fenced transaction given to `Store::complete`, after its rollback
/// (whose failure is only logged: the connection is closed then, and the
/// server rolls back).
pub(crate) fn fenced_given_to_complete(
    rolled_back: Result<(), impl std::fmt::Display>,
) -> StoreError {
    if let Err(e) = rolled_back {
        tracing::debug!(error = %e, "rolling back a misused fenced transaction failed");
    }
    StoreError::new(
        StoreErrorKind::TransactionAborted,
        "a fenced transaction commits with LeaseStore::commit_fenced; rolled back",
    )
}

/// A claim's transaction given to `LeaseStore::commit_fenced`.
pub(crate) fn claim_given_to_commit_fenced() -> StoreError {
    StoreError::new(
        StoreErrorKind::TransactionAborted,
        "a claim's transaction commits with Store::complete",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sql_states_sort_into_kinds() {
        use StoreErrorKind::*;
        for (code, kind) in [
            ("42P01", Schema),
            ("42703", Schema),
            ("40001", Conflict),
            ("40P01", Conflict),
            ("25P02", TransactionAborted),
            ("22012", TransactionAborted),
            ("23505", TransactionAborted),
            ("23503", TransactionAborted),
            ("08006", Unavailable),
            ("57P01", Unavailable),
            ("57P03", Unavailable),
            ("53300", Unavailable),
            ("57014", Unavailable),
            ("55P03", Unavailable),
            ("42601", Backend),
            ("22021", Backend),
        ] {
            assert_eq!(kind_of(code), kind, "{code}");
        }
        assert!(ends_only_the_statement("55P03") && ends_only_the_statement("57014"));
        assert!(!ends_only_the_statement("57P01") && !ends_only_the_statement("08006"));
    }
}
