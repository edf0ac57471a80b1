//! How the store's transactions begin and end: the three texts both
//! drivers send for it.

/// How every transaction of the store begins. The protocol is written for
/// READ COMMITTED: a duplicate's `INSERT … ON CONFLICT` waits on the owner's
/// row lock and then sees its commit, a loser's claim at commit fails on the
/// winner's row, a takeover reads the row's latest version. Under the
/// snapshot of REPEATABLE READ or SERIALIZABLE each of them would fail with
/// a serialization error instead, and a migrator that waited for another's
/// lock would not see its tables; so the level is named here, never left to
/// the database's `default_transaction_isolation`.
pub(crate) const BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

/// [`BEGIN`] without naming the level, for a session whose default level
/// was checked to be READ COMMITTED ([`DEFAULT_ISOLATION`], read as each
/// connection opens): the same
/// transaction, about 6,000 of PostgreSQL's instructions cheaper (the
/// clause is an option list to build and check on every `BEGIN`).
pub(crate) const BEGIN_DEFAULT: &str = "BEGIN";

/// The setting that holds a session's default isolation level
/// (`read committed` when [`BEGIN_DEFAULT`] may stand for [`BEGIN`]).
pub(crate) const DEFAULT_ISOLATION: &str = "default_transaction_isolation";

/// The level [`DEFAULT_ISOLATION`] must hold, as the setting spells it.
pub(crate) const READ_COMMITTED: &str = "read committed";

/// Ends a transaction, keeping its writes.
pub(crate) const COMMIT: &str = "COMMIT";

/// Ends a transaction, undoing its writes.
pub(crate) const ROLLBACK: &str = "ROLLBACK";
