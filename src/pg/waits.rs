//! How long the protocol waits, the same for both drivers: on a key's row
//! in the long-running mode, and for a statement still running when the
//! owner's transaction must end.

use std::time::Duration;

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
