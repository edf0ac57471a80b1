//! The statements both drivers send outside the long-running mode: the
//! claim-first mode's completion, the fenced transaction's check, and the session
//! reset. One text each; a driver adds only how it sends it.

use std::time::Duration;

use super::{
    identity::TxIdentity,
    record::key_params,
    sql::{Param, Sql},
    waits::millis,
};
use crate::{record::StoredResponse, store::ClaimRequest};

/// The completion's `UPDATE`, as a `WITH` named `done`, then `$tail`.
macro_rules! completion {
    ($tail:expr) => {
        concat!(
            "WITH done AS ( \
                 UPDATE idempotency_requests SET state = 'completed', response_status = $5::int2, \
                     response_headers = $6::bytea, response_body = $7::bytea, resource_id = $10::text, \
                     completed_at = statement_timestamp() \
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
/// connection reached directly: `$11` is the hold limit the session keeps
/// and `$12` the role the store logs in as (as in [`session_reset_keeping`]),
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
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) const COMPLETE_AND_RESET: Sql<'static> = Sql::new(completion!(concat!(
    "SELECT tower_idempotency_session_reset(CASE WHEN ",
    "1 / (SELECT count(*)::int FROM done) = 1 THEN $11::text END, $12::text)"
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

// What a request may have left on its session that would outlive it on a
// pooled connection, undone before anyone else gets the connection: what
// `DISCARD ALL` does except dropping prepared statements (the pool's cached
// statements live on). Sent pipelined behind the COMMIT or ROLLBACK, in a
// message of its own so that its outcome never blurs the commit's.
// `PgTx` (and `SqlxStore`'s guarded connection) refuses the plain ways to
// change the session; this catches the hidden ones (a function calling `set_config(…, false)` or taking a session
// advisory lock).
//
// Migration 3 puts them in a function, `tower_idempotency_session_reset()`,
// and the stores send one call of it (`SESSION_RESET`): measured with
// pgbench (benches/e2e `trials`), one-commit creates ran 7.7 % faster with
// the call than with the six pipelined as separate messages, which were
// already cheaper than one multi-statement message (an implicit
// transaction block, each statement with its own bookkeeping). This list is
// what the function runs, checked against the migration.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) const SESSION_RESET_STATEMENTS: [&str; 6] = [
    "SET SESSION AUTHORIZATION DEFAULT",
    "RESET ALL",
    "CLOSE ALL",
    "UNLISTEN *",
    "SELECT pg_advisory_unlock_all()",
    "DISCARD TEMP",
];

/// The session reset: one call of the function migration 3 creates (and 5
/// rewrites with static statements), which runs [`SESSION_RESET_STATEMENTS`].
#[cfg_attr(not(feature = "sqlx"), allow(dead_code))]
pub(crate) const SESSION_RESET: &str = "SELECT tower_idempotency_session_reset()";

/// The session reset of migration 4's function (rewritten by 5): the session's idle limit
/// left at `hold_limit` (for a store whose connections carry it,
/// [`set_hold_limit`], so that an owner whose hold limit is that one needs
/// no `SET LOCAL` of its own), and its authorization reset only when it is
/// not `login`'s, the role the store logs in as. The limit is a number
/// formatted here; the role name is written as an escaped literal.
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) fn session_reset_keeping(hold_limit: Option<Duration>, login: Option<&str>) -> String {
    let hold_limit = match hold_limit {
        Some(limit) => format!("'{}ms'", millis(limit)),
        None => "NULL".to_owned(),
    };
    let login = match login {
        Some(login) => escaped_literal(login),
        None => "NULL".to_owned(),
    };
    format!("SELECT tower_idempotency_session_reset({hold_limit}, {login})")
}

/// `text` as an escape string literal (`E'…'`): read the same whatever
/// `standard_conforming_strings` says.
fn escaped_literal(text: &str) -> String {
    format!("E'{}'", text.replace('\\', "\\\\").replace('\'', "''"))
}

/// Gives a new connection's session the idle limit `hold_limit`
/// (`idle_in_transaction_session_timeout`), which [`session_reset_keeping`]
/// then keeps.
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) fn set_hold_limit(hold_limit: Duration) -> String {
    format!(
        "SET idle_in_transaction_session_timeout = '{}ms'",
        millis(hold_limit)
    )
}

/// The one-commit mode's `INSERT`, returning `$returning`.
macro_rules! claim_at_commit {
    ($returning:expr) => {
        concat!(
            "INSERT INTO idempotency_requests \
                 (tenant_id, endpoint, idempotency_key, request_fingerprint, state, response_status, \
                  response_headers, response_body, resource_id, created_at, completed_at, expires_at) \
             VALUES ($1::text, $2::text, $3::text, $4::bytea, 'completed', $5::int2, $6::bytea, \
                 $7::bytea, $8::text, statement_timestamp(), statement_timestamp(), \
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
/// lost statement has failed before it); `$10` and `$11` are the hold limit
/// and the login, as `COMPLETE_AND_RESET`'s `$11` and `$12`.
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) const CLAIM_AT_COMMIT_AND_RESET: Sql<'static> = Sql::new(claim_at_commit!(
    "tower_idempotency_session_reset($10::text, $11::text)"
));

/// The SQLSTATE of a lost [`CLAIM_AT_COMMIT`]: a unique violation (the
/// key's row exists).
pub(crate) const LOST_AT_COMMIT: &str = "23505";

/// Whether the session is inside a transaction block: outside one a
/// statement is its own transaction, so `now()` and
/// `statement_timestamp()` are one instant (`t`); inside one the
/// transaction began with an earlier message (`f`), and a failed block
/// answers `25P02`. (A bare `ROLLBACK` would do too, but warns on every
/// clean connection.)
#[cfg(feature = "postgres")]
pub(crate) const OUTSIDE_A_TRANSACTION: &str = "SELECT now() = statement_timestamp()";

/// Cancels the statement running on the session with process id `pid`: a
/// simple query (the id is a number of ours, never client data), one round
/// trip, nothing prepared.
#[cfg(feature = "sqlx")]
pub(crate) fn cancel_backend(pid: i32) -> String {
    format!("SELECT pg_cancel_backend({pid})")
}

/// A statement whose columns are `NULL` cast to each of `types` (names as
/// [`USER_TYPES`] returns them): describing it makes a driver look each
/// type up and cache it.
pub(crate) fn describe_types(types: &[String]) -> String {
    let columns: Vec<String> = types.iter().map(|name| format!("NULL::{name}")).collect();
    format!("SELECT {}", columns.join(", "))
}

/// Drops the session's prepared statements (a driver's own type lookups
/// among them), on this server connection only.
pub(crate) const DEALLOCATE_ALL: &str = "DEALLOCATE ALL";

/// The user-defined types a handler's statements may meet (enums, domains,
/// ranges, base types such as `citext`, standalone composites, and arrays
/// of these), as `regtype` text: quoted and qualified as needed. Table row
/// types are left out. Behind a transaction pooler `PgStore` loads them into
/// each new connection's type cache (see `postgres/types.rs`), and
/// `sqlx::load_types` a connection's that it is given.
pub(crate) const USER_TYPES: &str = "SELECT t.oid::regtype::text FROM pg_type t \
     JOIN pg_namespace n ON n.oid = t.typnamespace \
     LEFT JOIN pg_class c ON c.oid = t.typrelid \
     LEFT JOIN pg_type e ON e.oid = t.typelem AND t.typcategory = 'A' \
     LEFT JOIN pg_class ec ON ec.oid = e.typrelid \
     WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') \
       AND n.nspname !~ '^pg_(toast|temp)' AND t.typisdefined \
       AND (c.oid IS NULL OR c.relkind = 'c') AND (ec.oid IS NULL OR ec.relkind = 'c') \
     ORDER BY t.oid";

/// [`COMPLETE`]'s parameters for the owner `id` and its `response`, whose
/// header block `headers` the caller encoded.
pub(crate) fn complete_params<'a>(
    id: &'a TxIdentity,
    response: &'a StoredResponse,
    headers: &'a [u8],
) -> [Param<'a>; 10] {
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

/// [`CLAIM_AT_COMMIT`]'s parameters for `request` and its `response`, whose
/// header block `headers` the caller encoded.
pub(crate) fn at_commit_params<'a>(
    request: &'a ClaimRequest,
    response: &'a StoredResponse,
    headers: &'a [u8],
) -> [Param<'a>; 9] {
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
    ]
}

#[cfg(test)]
mod reset_tests {
    /// The role name goes out as a literal that reads back as itself.
    #[test]
    fn the_login_is_escaped() {
        assert_eq!(
            super::session_reset_keeping(Some(std::time::Duration::from_secs(35)), Some(r"o'k\x")),
            r"SELECT tower_idempotency_session_reset('35000ms', E'o''k\\x')"
        );
        assert_eq!(
            super::session_reset_keeping(None, None),
            "SELECT tower_idempotency_session_reset(NULL, NULL)"
        );
    }

    /// The functions migrations 3 and 4 create run the list, in its order
    /// (4 then sets the hold limit); migration 5's run the same statements,
    /// static where PL/pgSQL allows, `DISCARD TEMP` last and only where the
    /// session has a temporary schema.
    #[test]
    fn the_session_reset_functions_run_the_list_of_statements() {
        for body in [
            include_str!("schema/0003_session_reset_function.sql"),
            include_str!("schema/0004_session_reset_keeps_hold_limit.sql"),
        ] {
            assert_eq!(run(body), listed(), "{body}");
        }
        let body = include_str!("schema/0005_session_reset_static.sql");
        let (no_arguments, keeping) = body
            .split_once("CREATE OR REPLACE FUNCTION tower_idempotency_session_reset(hold_limit")
            .expect("both functions");
        let mut moved = listed();
        moved.retain(|s| *s != "DISCARD TEMP");
        moved.push("DISCARD TEMP");
        for function in [no_arguments, keeping] {
            let statements = run(function);
            // The keeping function's two PERFORMs (one with the hold
            // limit) unlock the same way: one of them runs.
            let unlock = "pg_advisory_unlock_all()";
            let statements: Vec<&str> = statements
                .iter()
                .enumerate()
                .filter(|&(i, s)| *s != unlock || !statements[..i].contains(s))
                .map(|(_, s)| *s)
                .collect();
            assert_eq!(statements, moved, "{function}");
        }
        assert!(
            body.matches("IF pg_catalog.pg_my_temp_schema() <> 0 THEN\n        DISCARD TEMP;")
                .count()
                == 2,
            "DISCARD TEMP only with a temporary schema"
        );
    }

    /// The statements a reset function's body runs, in order: `EXECUTE`d
    /// strings, `PERFORM`ed calls (less `set_config`) and static statements.
    fn run(body: &str) -> Vec<&str> {
        body.lines()
            .map(str::trim)
            .filter_map(|line| {
                if let Some(text) = line.strip_prefix("EXECUTE '") {
                    return text.strip_suffix("';");
                }
                if let Some(call) = line.strip_prefix("PERFORM ") {
                    let call = call.trim_end_matches([';', ',']);
                    let call = call.strip_prefix("pg_catalog.").unwrap_or(call);
                    return (!call.starts_with("set_config(")).then_some(call);
                }
                let statement = line.strip_suffix(';')?;
                super::SESSION_RESET_STATEMENTS
                    .contains(&statement)
                    .then_some(statement)
            })
            .collect()
    }

    /// The list, with `PERFORM`'s view of the `SELECT`.
    fn listed() -> Vec<&'static str> {
        super::SESSION_RESET_STATEMENTS
            .iter()
            .map(|s| s.strip_prefix("SELECT ").unwrap_or(s))
            .collect()
    }
}
