//! How long the protocol waits, the same for both drivers: on a key's row
//! in the long-running mode, and for a statement still running when the
//! owner's transaction must end; and a wait as PostgreSQL's settings take
//! it ([`millis`]).

use std::time::Duration;

/// A wait as PostgreSQL's settings take it: whole milliseconds, at least
/// 1 (`0` would mean "no limit") and at most `i32::MAX`.
pub(crate) fn millis(d: Duration) -> u128 {
    d.as_millis().clamp(1, i32::MAX as u128)
}

/// How long a heartbeat, finish, release or recovery waits for the row, and
/// how long a fenced transaction waits to hold it (a takeover in flight).
pub(crate) const ROW_WAIT: Duration = Duration::from_secs(5);
/// Room beyond a wait for the server to report its own lock timeout.
pub(crate) const GRACE: Duration = Duration::from_millis(250);
/// The shortest wait an acquire gets.
pub(crate) const MIN_WAIT: Duration = Duration::from_millis(100);

/// How long a `ROLLBACK` may queue behind a statement still running on the
/// connection (a handler cut off at its deadline) before that statement is
/// cancelled, and how long the cancelled statement then has to end.
pub(crate) const ROLLBACK_PATIENCE: Duration = Duration::from_millis(500);
pub(crate) const CANCEL_GRACE: Duration = Duration::from_secs(5);

/// How long a cancel request may take. It travels on a connection of its
/// own, over the same network as the statement it cancels: across a
/// partition it would wait as long as the partition lasts, so it is given
/// up after this and the connection it was for is closed instead.
pub(crate) const CANCEL_DEADLINE: Duration = Duration::from_secs(2);

/// How long ending an owner's transaction (the completion, the one-commit
/// mode's commit, a fenced commit) waits for a statement that a task of the
/// handler still runs through a clone of the handle, or a connection such a
/// task holds: the statement would commit with the response. Past it the
/// statement is cancelled and the transaction rolled back (`503`): the
/// handler's deadline does not cover its tasks, and nothing else bounds them.
pub(crate) const COMMIT_PATIENCE: Duration = Duration::from_secs(5);

/// How long a background task's database phase (an outbox batch's claim
/// or record, a cleanup batch, a gauge's read) may take before the task
/// gives up on the database for this round and closes the connection: a
/// network path that stopped moving bytes answers nothing, and nothing on
/// the server's side can end the wait.
pub(crate) const BACKGROUND_DEADLINE: Duration = Duration::from_secs(10);

/// `call`, answered within `limit`, or an `Unavailable` error saying what
/// was cut off (`what`); the call is dropped, and with it its connection
/// (never pooled again: it may be inside a transaction).
pub(crate) async fn answered_within<T>(
    limit: Duration,
    call: impl std::future::Future<Output = Result<T, crate::store::StoreError>>,
    what: &str,
) -> Result<T, crate::store::StoreError> {
    match tokio::time::timeout(limit, call).await {
        Ok(answered) => answered,
        Err(_) => Err(crate::store::StoreError::new(
            crate::store::StoreErrorKind::Unavailable,
            format!(
                "the database did not answer ({what}) within {} s; the connection was closed",
                limit.as_secs()
            ),
        )),
    }
}

/// The answer when [`COMMIT_PATIENCE`] ran out.
pub(crate) fn commit_gave_up() -> crate::store::StoreError {
    crate::store::StoreError::new(
        crate::store::StoreErrorKind::Unavailable,
        "a statement a task of the handler left running did not end within 5 s; \
         it was cancelled and the transaction rolled back",
    )
}
