//! How an owner's transaction ends with its work: the claim-first mode's
//! completion ([`COMPLETE`], and [`COMPLETE_AND_RESET`] with the session
//! reset in the same statement) and the fenced transaction's check
//! ([`FENCED_CHECK`]), each guarded so that a lost owner's `COMMIT` rolls
//! back, and their parameters. One text each; a driver adds only how it
//! sends it.

use super::{
    identity::TxIdentity,
    sql::{Param, Sql},
};
use crate::record::{StoredResponse, TraceText};

/// The completion's `UPDATE`, as a `WITH` named `done`, then `$tail`.
macro_rules! completion {
    ($tail:expr) => {
        concat!(
            "WITH done AS ( \
                 UPDATE idempotency_requests SET state = 'completed', response_status = $5::int2, \
                     response_headers = $6::bytea, response_body = $7::bytea, resource_id = $10::text, \
                     trace_id = $11::text, completed_at = statement_timestamp() \
                 WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text \
                     AND attempt_token = $4::int8 AND state = 'in_progress' \
                     AND pg_current_xact_id() = $9::text::xid8 AND $8::float8 IS NOT NULL \
                 RETURNING 1) ",
            $tail
        )
    };
}

// The COMMIT is pipelined behind this statement, so it must fail (aborting
// the transaction) rather than match no row: the handler's writes must never
// commit without the remembered response. Division by zero does that. The
// transaction id check catches a handler that ended the claim's transaction.
//
// A heap-only-tuple (HOT) update: it changes no indexed column and no column
// of an index's predicate (`state` is in none, see `schema/0001_baseline.sql`;
// `tests/layer/hot_completion.rs` checks both the catalog and the statistics), so
// with the table's fillfactor the new row version stays on its page and no
// index is touched. That is why it leaves `expires_at` (indexed, for
// cleanup) as the claim set it: retention counts from the claim, and the
// claim's transaction is bounded by the handler's timeout, seconds against
// a retention of hours. `$8` (the retention) is no longer needed; it stays
// a parameter so that both drivers bind the same list.
pub(crate) const COMPLETE: Sql<'static> =
    Sql::new(completion!("SELECT 1 / (SELECT count(*)::int FROM done)"));

/// [`COMPLETE`] with the session reset in the same statement, for a
/// connection reached directly: `$12` is the hold limit the session keeps
/// and `$13` the role the store logs in as (as in
/// [`session_reset_keeping`](super::session_reset::session_reset_keeping)),
/// each or both `NULL`.
///
/// The reset (the function of migrations 4 and 5) runs inside the owner's
/// transaction, after everything the handler sent, and commits with it:
/// once the `COMMIT` is through, the settings, role, cursors, listeners
/// and temporary objects a handler's function may have changed are the
/// defaults again, and session advisory locks are released, without a
/// message of its own (one statement fewer a request). It sets the
/// session's hold limit again in the same call, so the idle limit holds
/// until the `COMMIT` arrives. It runs only once the statement has won:
/// its argument needs the division first, and a lost or failed statement
/// aborts the transaction before it (the driver then sends the reset on
/// its own behind the `ROLLBACK`: a rolled-back transaction undoes its
/// settings, cursors, listeners and temporary objects, but not session
/// advisory locks). Not on Citus, where a router query runs its functions
/// on the worker, nor behind a transaction pooler (the session is the
/// pooler's).
pub(crate) const COMPLETE_AND_RESET: Sql<'static> = Sql::new(completion!(concat!(
    "SELECT tower_idempotency_session_reset(CASE WHEN ",
    "1 / (SELECT count(*)::int FROM done) = 1 THEN $12::text END, $13::text)"
)));

// A fenced transaction's commit, guarded like the completion: the check
// fails (aborting the transaction, so the pipelined COMMIT rolls back) if
// the handler let a statement fail and went on, if it ended the
// transaction itself, or if the record is no longer at this token (it
// cannot be while the row is held FOR SHARE; the check costs nothing).
pub(crate) const FENCED_CHECK: Sql<'static> = Sql::new(
    "SELECT 1 / (SELECT count(*)::int FROM idempotency_requests \
     WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text \
         AND attempt_token = $4::int8 AND state = 'in_progress' \
         AND pg_current_xact_id() = $5::text::xid8)",
);

/// [`COMPLETE`]'s parameters for the owner `id` and its `response`, whose
/// header block `headers` the caller encoded.
pub(crate) fn complete_params<'a>(
    id: &'a TxIdentity,
    response: &'a StoredResponse,
    headers: &'a [u8],
    trace: Option<&'a TraceText>,
) -> [Param<'a>; 11] {
    let (tenant, endpoint, key, token) = id.columns();
    [
        Param::Text(tenant),
        Param::Text(endpoint),
        Param::Text(key),
        Param::Int8(token),
        Param::Int2(response.status.as_u16() as i16),
        Param::Bytea(headers),
        Param::Bytea(&response.body),
        Param::from(id.retention()),
        Param::Text(id.xid()),
        Param::OptText(response.resource_id.as_ref().map(|id| id.as_str())),
        Param::OptText(trace.map(TraceText::as_str)),
    ]
}

/// [`FENCED_CHECK`]'s parameters for the owner `id`.
pub(crate) fn fenced_check_params(id: &TxIdentity) -> [Param<'_>; 5] {
    let (tenant, endpoint, key, token) = id.columns();
    [
        Param::Text(tenant),
        Param::Text(endpoint),
        Param::Text(key),
        Param::Int8(token),
        Param::Text(id.xid()),
    ]
}
