//! The one-commit mode's claim: the key's record inserted completed, with
//! the response, as the last statement of the handler's transaction and
//! pipelined with its `COMMIT` ([`CLAIM_AT_COMMIT`], and
//! [`CLAIM_AT_COMMIT_AND_RESET`] with the session reset), the SQLSTATE of
//! one that lost ([`LOST_AT_COMMIT`]), and its parameters.

use super::{
    record::key_params,
    sql::{Param, Sql},
};
use crate::{
    record::{StoredResponse, TraceText},
    store::ClaimRequest,
};

/// The one-commit mode's `INSERT`, returning `$returning`.
macro_rules! claim_at_commit {
    ($returning:expr) => {
        concat!(
            "INSERT INTO idempotency_requests \
                 (tenant_id, endpoint, idempotency_key, request_fingerprint, state, response_status, \
                  response_headers, response_body, resource_id, trace_id, created_at, completed_at, \
                  expires_at) \
             VALUES ($1::text, $2::text, $3::text, $4::bytea, 'completed', $5::int2, $6::bytea, \
                 $7::bytea, $8::text, $10::text, statement_timestamp(), statement_timestamp(), \
                 statement_timestamp() + make_interval(secs => $9::float8)) \
             RETURNING ",
            $returning
        )
    };
}

// The one-commit mode's claim, sent last in the handler's transaction and
// pipelined with its COMMIT: the key's record goes in completed, with the
// response. The unique key decides, as a plain INSERT: a free key is won;
// a key another commit is inserting makes this statement wait for that
// commit, and then fail if it committed; a key with any committed row
// fails it at once. Failing aborts the transaction, so that the pipelined
// COMMIT rolls the handler's writes back: a unique violation (SQLSTATE
// 23505; no other can come from this statement, which inserts the key's
// row alone). The store then reads the key with a fresh snapshot
// (`claim::winner`): a record to answer, or a row that may be taken over
// (expired, or an orphan, as the claim-first mode's takeover), which it
// deletes ([`FREE`](super::claim::FREE)) and answers `Committed::Freed`,
// so that the layer runs the work again on the free key. A takeover costs a
// second run of the handler, once per key per retention period at most;
// in exchange PostgreSQL runs no takeover rule for a create: against
// `INSERT … ON CONFLICT … DO UPDATE` with the rule in its `SET` (which
// this statement was), it counts about 46,000 instructions fewer a create
// (callgrind, `benches/pg_instructions.rs`): no probe of the key's index
// before the insert, no 17-column projection set up at every execution.
// What every create still pays for the rare case is in the layer: a copy
// of the request's parts for the second run (about 2,000 instructions of
// the process's side, within that side's spread). On Citus a router query.
// The record is created at this commit (`created_at` too: the
// transaction's start is the handler's, not the record's). Retention counts
// from this commit, and expiry is judged at it too: a record that expired
// while the handler worked is freed at commit and won by the second run,
// on every store alike (the conformance check
// `a_record_that_expires_during_the_work_is_won_at_commit`).
pub(crate) const CLAIM_AT_COMMIT: Sql<'static> = Sql::new(claim_at_commit!("1"));

/// [`CLAIM_AT_COMMIT`] with the session reset in the same statement, run
/// only once the key is won (`RETURNING` runs for the row written, and a
/// lost statement has failed before it); `$11` and `$12` are the hold limit
/// and the login, as `COMPLETE_AND_RESET`'s `$12` and `$13`.
pub(crate) const CLAIM_AT_COMMIT_AND_RESET: Sql<'static> = Sql::new(claim_at_commit!(
    "tower_idempotency_session_reset($11::text, $12::text)"
));

/// The SQLSTATE of a lost [`CLAIM_AT_COMMIT`]: a unique violation (the
/// key's row exists).
pub(crate) const LOST_AT_COMMIT: &str = "23505";

/// [`CLAIM_AT_COMMIT`]'s parameters for `request` and its `response`, whose
/// header block `headers` the caller encoded.
pub(crate) fn at_commit_params<'a>(
    request: &'a ClaimRequest,
    response: &'a StoredResponse,
    headers: &'a [u8],
    trace: Option<&'a TraceText>,
) -> [Param<'a>; 10] {
    let [tenant, endpoint, key] = key_params(request);
    [
        tenant,
        endpoint,
        key,
        Param::Bytea(request.fingerprint.as_bytes().as_slice()),
        Param::Int2(response.status.as_u16() as i16),
        Param::Bytea(headers),
        Param::Bytea(&response.body),
        Param::OptText(response.resource_id.as_ref().map(|id| id.as_str())),
        Param::from(request.retention),
        Param::OptText(trace.map(TraceText::as_str)),
    ]
}
