//! Just enough of PostgreSQL's SQL scanner to tell what each statement does,
//! so that [`PgTx`](super::PgTx) (and `SqlxStore`'s guarded connection) can
//! refuse statements that would end the layer's transaction or change the
//! pooled session for later requests.
//!
//! The lexer follows PostgreSQL's (`src/backend/parser/scan.l`) wherever a
//! token's boundary decides what counts as a keyword: strings in all their
//! forms (`'…'`, `E'…'`, `B'…'`, `X'…'`, `N'…'`, `U&'…'`, `$tag$…$tag$`, and
//! a `'…'` continued after a newline), quoted identifiers (`"…"`, `U&"…"`),
//! `--` comments (which end at `\n` or `\r`), nested `/* */` comments and
//! whitespace (`[ \t\n\r\f\v]`). A `;` or a keyword inside a string or a
//! comment counts for nothing. Bytes of non-ASCII characters outside quotes
//! are identifier letters, as in PostgreSQL, so `COMMITé` is not `COMMIT`.
//!
//! It fails closed: text it cannot follow is refused, as transaction control,
//! rather than guessed at, because a misread quote would hide everything after
//! it. That covers unterminated strings, identifiers and comments, NUL bytes,
//! control characters outside strings and comments, and `UESCAPE` after
//! `U&"…"`. PostgreSQL rejects nearly all of these itself, so the refusal
//! costs nothing.
//!
//! Whether a backslash escapes a quote in a plain `'…'` depends on
//! `standard_conforming_strings`: on by default, but a role may have it off
//! and a handler may `SET LOCAL` it. So text with a backslash is read both
//! ways, and what either reading refuses is refused.

mod scan;
mod token;

use scan::{Lexer, Stop};
use token::Token;

/// Why a statement is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// BEGIN, START, COMMIT, END, ABORT, ROLLBACK (but not ROLLBACK TO),
    /// PREPARE TRANSACTION, COMMIT/ROLLBACK PREPARED; also text the lexer
    /// cannot follow (see the module docs).
    TransactionControl,
    /// Something that would outlive the transaction on the pooled connection:
    /// a session-level SET/RESET, prepared statements, LISTEN, temporary
    /// objects, WITH HOLD cursors, `set_config` and session advisory locks.
    SessionState,
}

/// The first refused statement in `sql`, if any.
pub(crate) fn refusal(sql: &str) -> Option<Refusal> {
    // The server reads query text only up to a NUL.
    if sql.contains('\0') {
        return Some(Refusal::TransactionControl);
    }
    let standard = match Lexer::new(sql, true).tokens() {
        Ok(tokens) => first_refusal(&tokens),
        Err(_) => return Some(Refusal::TransactionControl),
    };
    if standard.is_some() || !sql.contains('\\') {
        return standard;
    }
    // The reading with standard_conforming_strings off. Text that this
    // reading rejects is rejected whole by a server in that mode, before any
    // of it runs; `'C:\'` is such text, and fine under the default.
    match Lexer::new(sql, false).tokens() {
        Ok(tokens) => first_refusal(&tokens),
        Err(Stop::Rejected) => None,
        Err(Stop::Unfollowed) => Some(Refusal::TransactionControl),
    }
}

/// Functions whose effect outlives the transaction. `set_config(…, true)`
/// would be fine, but a call cannot be told apart from `set_config(…,
/// false)` without evaluating it; `SET LOCAL` can.
const SESSION_FUNCTIONS: [&str; 5] = [
    "set_config",
    "pg_advisory_lock",
    "pg_advisory_lock_shared",
    "pg_try_advisory_lock",
    "pg_try_advisory_lock_shared",
];

fn first_refusal(tokens: &[Token<'_>]) -> Option<Refusal> {
    tokens
        .split(|token| matches!(token, Token::Other(b';')))
        .find_map(statement_refusal)
}

fn statement_refusal(statement: &[Token<'_>]) -> Option<Refusal> {
    let parens = statement
        .iter()
        .take_while(|token| matches!(token, Token::Other(b'(')))
        .count();
    leading_refusal(&statement[parens..]).or_else(|| inner_refusal(statement))
}

/// Refusals decided by the keywords a statement starts with.
fn leading_refusal(statement: &[Token<'_>]) -> Option<Refusal> {
    use Refusal::{SessionState, TransactionControl};
    let is = |i: usize, keyword: &str| statement.get(i).is_some_and(|t| t.is(keyword));
    let Some(Token::Word(first)) = statement.first() else {
        return None;
    };
    match first.to_ascii_uppercase().as_str() {
        "BEGIN" | "START" | "COMMIT" | "END" | "ABORT" => Some(TransactionControl),
        "ROLLBACK" => {
            let to = if is(1, "WORK") || is(1, "TRANSACTION") {
                2
            } else {
                1
            };
            (!is(to, "TO")).then_some(TransactionControl)
        }
        "PREPARE" if is(1, "TRANSACTION") => Some(TransactionControl),
        // SET LOCAL ends with the transaction; but another client encoding
        // would change how the server reads the next text this lexer reads.
        "SET" if is(1, "LOCAL") => {
            let encoding =
                is(2, "NAMES") || statement.get(2).is_some_and(|t| t.names("client_encoding"));
            encoding.then_some(SessionState)
        }
        "SET" if is(1, "TRANSACTION") || is(1, "CONSTRAINTS") => None,
        "SET" | "RESET" | "PREPARE" | "EXECUTE" | "DEALLOCATE" | "LISTEN" | "UNLISTEN"
        | "DISCARD" | "LOAD" => Some(SessionState),
        _ => None,
    }
}

/// Refusals wherever the words appear in a statement (`EXPLAIN ANALYZE
/// CREATE TEMP TABLE …` creates the table too).
fn inner_refusal(statement: &[Token<'_>]) -> Option<Refusal> {
    let declares = statement.iter().any(|t| t.is("DECLARE"));
    let outlives = statement.iter().enumerate().any(|(i, token)| {
        let before = i.checked_sub(1).and_then(|p| statement.get(p));
        let after = &statement[i + 1..];
        SESSION_FUNCTIONS.iter().any(|f| token.names(f))
            // `pg_temp.t` creates, or finds, an object in the session's temporary schema.
            || (token.names_temp_schema() && matches!(after.first(), Some(Token::Other(b'.'))))
            || (token.is("CREATE") && creates_temporary(after))
            // SELECT … INTO TEMP t; `INSERT INTO temp` is a table named temp.
            || (token.is("INTO")
                && !before.is_some_and(|t| t.is("INSERT") || t.is("MERGE"))
                && temporary(after))
            || (declares && token.is("WITH") && after.first().is_some_and(|t| t.is("HOLD")))
    });
    outlives.then_some(Refusal::SessionState)
}

/// `[OR REPLACE] [LOCAL | GLOBAL] TEMP[ORARY]` after CREATE.
fn creates_temporary(after_create: &[Token<'_>]) -> bool {
    match after_create {
        [or, replace, rest @ ..] if or.is("OR") && replace.is("REPLACE") => temporary(rest),
        _ => temporary(after_create),
    }
}

/// `[LOCAL | GLOBAL] TEMP[ORARY]`.
fn temporary(words: &[Token<'_>]) -> bool {
    let words = match words {
        [scope, rest @ ..] if scope.is("LOCAL") || scope.is("GLOBAL") => rest,
        _ => words,
    };
    words
        .first()
        .is_some_and(|t| t.is("TEMP") || t.is("TEMPORARY"))
}

#[cfg(test)]
mod tests;
