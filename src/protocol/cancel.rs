//! Cancelling a statement still running on a session, for a driver that
//! cancels with a query of its own rather than a cancel request.

/// Cancels the statement running on the session with process id `pid`: a
/// simple query (the id is a number of ours, never client data), one round
/// trip, nothing prepared.
pub(crate) fn cancel_backend(pid: i32) -> String {
    format!("SELECT pg_cancel_backend({pid})")
}
