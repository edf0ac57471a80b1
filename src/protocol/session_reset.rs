//! The session reset: what a request may have left on its pooled
//! connection's session, undone before anyone else gets it
//! ([`SESSION_RESET`], [`session_reset_keeping`]; what the reset function
//! runs, [`SESSION_RESET_STATEMENTS`]), the idle limit a new connection's
//! session carries ([`set_hold_limit`]), and the check that a borrowed
//! connection is outside a transaction block before its reset
//! ([`OUTSIDE_A_TRANSACTION`]).

use std::time::Duration;

use super::waits::millis;

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
pub(crate) const SESSION_RESET: &str = "SELECT tower_idempotency_session_reset()";

/// The session reset of migration 4's function (rewritten by 5): the session's idle limit
/// left at `hold_limit` (for a store whose connections carry it,
/// [`set_hold_limit`], so that an owner whose hold limit is that one needs
/// no `SET LOCAL` of its own), and its authorization reset only when it is
/// not `login`'s, the role the store logs in as. The limit is a number
/// formatted here; the role name is written as an escaped literal.
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
pub(crate) fn set_hold_limit(hold_limit: Duration) -> String {
    format!(
        "SET idle_in_transaction_session_timeout = '{}ms'",
        millis(hold_limit)
    )
}

/// The setting a hold limit is: asked for as each connection starts
/// (where the server takes startup options), else set by [`set_hold_limit`].
pub(crate) const HOLD_LIMIT_SETTING: &str = "idle_in_transaction_session_timeout";

/// A hold limit as the setting takes it.
pub(crate) fn hold_limit_value(hold_limit: Duration) -> String {
    format!("{}ms", millis(hold_limit))
}

/// Whether a new connection's session already has the idle limit
/// `hold_limit` (`t` or `f`: it asked for it as it started, and the server
/// took it), and its default isolation level: one statement, as each
/// connection opens.
pub(crate) fn check_hold_limit(hold_limit: Duration) -> String {
    use super::transaction::DEFAULT_ISOLATION;
    format!(
        "SELECT pg_catalog.current_setting('{HOLD_LIMIT_SETTING}')::interval \
             = interval '{} milliseconds', \
         pg_catalog.current_setting('{DEFAULT_ISOLATION}')",
        millis(hold_limit)
    )
}

/// Whether the session is inside a transaction block: outside one a
/// statement is its own transaction, so `now()` and
/// `statement_timestamp()` are one instant (`t`); inside one the
/// transaction began with an earlier message (`f`), and a failed block
/// answers `25P02`. (A bare `ROLLBACK` would do too, but warns on every
/// clean connection.)
pub(crate) const OUTSIDE_A_TRANSACTION: &str = "SELECT now() = statement_timestamp()";

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
