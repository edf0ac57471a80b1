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
//!
//! Code in a string is read too where it runs in this session: the body of
//! a `DO` block, and that of a function or procedure being created (PL/pgSQL
//! and SQL share this scanner). It is refused where a statement would be,
//! and wherever the guard cannot read it: dynamic SQL (`EXECUTE`), another
//! language, a body whose text is not certain (see [`Token::Literal`]). What
//! a function created earlier runs cannot be seen: see
//! `docs/transaction.md` for what the session reset covers then.

mod scan;
mod token;

use std::borrow::Cow;

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
    /// objects (and a search_path naming `pg_temp`, which makes an
    /// unqualified CREATE temporary), WITH HOLD cursors, `set_config` but for
    /// a call that is surely transaction-local, an UPDATE of `pg_settings`
    /// (its rule calls `set_config(…, false)`), session advisory locks,
    /// functions that run SQL text; and such statements in a `DO` block or in
    /// the body of a function being created, or a body the guard cannot read.
    SessionState,
}

/// The first refused statement in `sql`, if any.
///
/// The verdict depends on the text alone, and a handler sends the same
/// static texts on every request, so each thread remembers the verdicts of
/// the texts it judged (up to [`REMEMBERED`] texts of at most
/// [`REMEMBERED_LEN`] bytes, forgotten all at once when full): measured
/// with `perf`, lexing every statement again was the largest single part
/// of the layer's own CPU per create.
pub(crate) fn refusal(sql: &str) -> Option<Refusal> {
    use std::{cell::RefCell, collections::HashMap};
    thread_local! {
        static VERDICTS: RefCell<HashMap<Box<str>, Option<Refusal>>> = RefCell::new(HashMap::new());
    }
    if sql.len() > REMEMBERED_LEN {
        return judge(sql);
    }
    if let Some(verdict) = VERDICTS.with(|v| v.borrow().get(sql).copied()) {
        return verdict;
    }
    let verdict = judge(sql);
    VERDICTS.with(|v| {
        let mut v = v.borrow_mut();
        if v.len() >= REMEMBERED {
            v.clear();
        }
        v.insert(sql.into(), verdict);
    });
    verdict
}

/// Texts each thread remembers the verdict of.
const REMEMBERED: usize = 512;
/// The longest text remembered, in bytes.
const REMEMBERED_LEN: usize = 4096;

/// [`refusal`], judged afresh.
fn judge(sql: &str) -> Option<Refusal> {
    // The server reads query text only up to a NUL.
    if sql.contains('\0') {
        return Some(Refusal::TransactionControl);
    }
    read(sql, Refusal::TransactionControl, |tokens| {
        statements(tokens).find_map(statement_refusal)
    })
}

/// What `judge` makes of the tokens of `sql`, read with
/// standard_conforming_strings on and, if `sql` has a backslash, off;
/// `unreadable` for text the lexer cannot follow.
fn read(
    sql: &str,
    unreadable: Refusal,
    judge: impl Fn(&[Token<'_>]) -> Option<Refusal>,
) -> Option<Refusal> {
    let standard = match Lexer::new(sql, true).tokens() {
        Ok(tokens) => judge(&tokens),
        Err(_) => return Some(unreadable),
    };
    if standard.is_some() || !sql.contains('\\') {
        return standard;
    }
    // The reading with standard_conforming_strings off. Text that this
    // reading rejects is rejected whole by a server in that mode, before any
    // of it runs; `'C:\'` is such text, and fine under the default.
    match Lexer::new(sql, false).tokens() {
        Ok(tokens) => judge(&tokens),
        Err(Stop::Rejected) => None,
        Err(Stop::Unfollowed) => Some(unreadable),
    }
}

fn statements<'t, 'a>(tokens: &'t [Token<'a>]) -> impl Iterator<Item = &'t [Token<'a>]> {
    tokens.split(|token| matches!(token, Token::Other(b';')))
}

/// Functions whose effect outlives the transaction. `set_config(…, true)`
/// does not, and is let through where the call shows it (see
/// [`sets_local_config`]).
const SESSION_FUNCTIONS: [&str; 5] = [
    "set_config",
    "pg_advisory_lock",
    "pg_advisory_lock_shared",
    "pg_try_advisory_lock",
    "pg_try_advisory_lock_shared",
];

/// Functions that run SQL text, where the guard cannot read it (a
/// `set_config(…, false)` there changes the session): `ts_rewrite` with two
/// arguments (its second is a query), and these always.
const SQL_TEXT_FUNCTIONS: [&str; 3] = ["query_to_xml", "query_to_xml_and_xmlschema", "ts_stat"];

/// How deeply bodies are read inside bodies (a `DO` block in a `DO`
/// block…); deeper ones are refused.
const MAX_NESTING: usize = 4;

fn statement_refusal(statement: &[Token<'_>]) -> Option<Refusal> {
    let leading = after_parens(statement);
    transaction_control(leading)
        .or_else(|| session_statement(leading, 0))
        .or_else(|| inner_refusal(statement))
}

fn after_parens<'t, 'a>(statement: &'t [Token<'a>]) -> &'t [Token<'a>] {
    let parens = statement
        .iter()
        .take_while(|token| matches!(token, Token::Other(b'(')))
        .count();
    &statement[parens..]
}

/// Statements that end the transaction, by the keywords they start with.
fn transaction_control(statement: &[Token<'_>]) -> Option<Refusal> {
    let is = |i: usize, keyword: &str| statement.get(i).is_some_and(|t| t.is(keyword));
    let Some(Token::Word(first)) = statement.first() else {
        return None;
    };
    match first.to_ascii_uppercase().as_str() {
        "BEGIN" | "START" | "COMMIT" | "END" | "ABORT" => Some(Refusal::TransactionControl),
        "ROLLBACK" => {
            let to = if is(1, "WORK") || is(1, "TRANSACTION") {
                2
            } else {
                1
            };
            (!is(to, "TO")).then_some(Refusal::TransactionControl)
        }
        "PREPARE" if is(1, "TRANSACTION") => Some(Refusal::TransactionControl),
        _ => None,
    }
}

/// Session changes decided by the keywords a statement starts with; the
/// bodies of `DO` blocks and of functions created are read at `depth` + 1.
fn session_statement(statement: &[Token<'_>], depth: usize) -> Option<Refusal> {
    use Refusal::SessionState;
    let is = |i: usize, keyword: &str| statement.get(i).is_some_and(|t| t.is(keyword));
    let Some(Token::Word(first)) = statement.first() else {
        return None;
    };
    match first.to_ascii_uppercase().as_str() {
        // SET LOCAL ends with the transaction; but another client encoding
        // would change how the server reads the next text this lexer reads.
        // (A search_path naming pg_temp: see `inner_refusal`.)
        "SET" if is(1, "LOCAL") => {
            let encoding =
                is(2, "NAMES") || statement.get(2).is_some_and(|t| t.names("client_encoding"));
            encoding.then_some(SessionState)
        }
        "SET" if is(1, "TRANSACTION") || is(1, "CONSTRAINTS") => None,
        "SET" | "RESET" | "PREPARE" | "EXECUTE" | "DEALLOCATE" | "LISTEN" | "UNLISTEN"
        | "DISCARD" | "LOAD" => Some(SessionState),
        "DO" => do_block(&statement[1..], depth),
        "CREATE" => create(&statement[1..], depth),
        _ => None,
    }
}

/// `DO [LANGUAGE name] body`: the body runs now.
fn do_block(items: &[Token<'_>], depth: usize) -> Option<Refusal> {
    let mut language = None;
    let mut bodies = Vec::new();
    let mut items = items.iter();
    while let Some(item) = items.next() {
        if item.is("LANGUAGE") {
            language = items.next();
        } else if let Token::Literal(body) = item {
            bodies.push(body);
        }
    }
    code(language, &["plpgsql"], &bodies, depth)
}

/// `CREATE …`: a view (or rule, or table) over pg_settings, or a function
/// or procedure whose body would change the session when called.
fn create(after_create: &[Token<'_>], depth: usize) -> Option<Refusal> {
    // An UPDATE of a simple view over pg_settings fires pg_settings' rule.
    if after_create.iter().any(|t| t.names("pg_settings")) {
        return Some(Refusal::SessionState);
    }
    let what = match after_create {
        [or, replace, what, ..] if or.is("OR") && replace.is("REPLACE") => what,
        [what, ..] => what,
        [] => return None,
    };
    if !what.is("FUNCTION") && !what.is("PROCEDURE") {
        return None;
    }
    // The last LANGUAGE: a parameter may be named language.
    let language = after_create
        .iter()
        .rposition(|t| t.is("LANGUAGE"))
        .and_then(|i| after_create.get(i + 1));
    // `AS 'body'`, or `AS 'file', 'symbol'` (C): the string right after AS.
    // A SQL-standard body (`RETURN …`, `BEGIN ATOMIC … END`) is statement
    // text, read as such.
    let bodies: Vec<_> = after_create
        .windows(2)
        .filter_map(|pair| match pair {
            [as_, Token::Literal(body)] if as_.is("AS") => Some(body),
            _ => None,
        })
        .collect();
    code(language, &["sql", "plpgsql"], &bodies, depth)
}

/// Bodies in `language` (the first of `readable` if not given): read when
/// the language is one the guard reads, refused otherwise.
fn code(
    language: Option<&Token<'_>>,
    readable: &[&str],
    bodies: &[&Option<Cow<'_, str>>],
    depth: usize,
) -> Option<Refusal> {
    if bodies.is_empty() {
        return None;
    }
    let readable = language.is_none_or(|language| match language {
        Token::Literal(Some(name)) => readable.iter().any(|l| name.eq_ignore_ascii_case(l)),
        _ => readable.iter().any(|l| language.names(l)),
    });
    if !readable {
        return Some(Refusal::SessionState);
    }
    bodies.iter().find_map(|body| match body {
        Some(body) => body_refusal(body, depth + 1),
        None => Some(Refusal::SessionState),
    })
}

/// The body of a `DO` block or function. Transaction control there fails
/// inside the layer's transaction ("invalid transaction termination"), so
/// `BEGIN` and `END` are PL/pgSQL's block; session changes are refused, and
/// so is dynamic SQL, which the guard cannot read.
fn body_refusal(body: &str, depth: usize) -> Option<Refusal> {
    if depth > MAX_NESTING || body.contains('\0') {
        return Some(Refusal::SessionState);
    }
    read(body, Refusal::SessionState, |tokens| {
        statements(tokens).find_map(|statement| {
            if statement.iter().any(|t| t.is("EXECUTE")) {
                return Some(Refusal::SessionState);
            }
            (0..statement.len())
                .filter(|&i| i == 0 || opens_statement(&statement[..i]))
                .find_map(|i| session_statement(after_parens(&statement[i..]), depth))
                .or_else(|| inner_refusal(statement))
        })
    })
}

/// Whether a PL/pgSQL statement may start after `before`: after a block's
/// `BEGIN`, `THEN`, `ELSE`, `LOOP` or a `<<label>>`. (A `;` splits
/// statements already.)
fn opens_statement(before: &[Token<'_>]) -> bool {
    match before {
        [.., Token::Other(b'>'), Token::Other(b'>')] => true,
        [.., last] => ["BEGIN", "THEN", "ELSE", "LOOP"].iter().any(|k| last.is(k)),
        [] => true,
    }
}

/// Refusals wherever the words appear in a statement (`EXPLAIN ANALYZE
/// CREATE TEMP TABLE …` creates the table too).
fn inner_refusal(statement: &[Token<'_>]) -> Option<Refusal> {
    let declares = statement.iter().any(|t| t.is("DECLARE"));
    let outlives = statement.iter().enumerate().any(|(i, token)| {
        let before = i.checked_sub(1).and_then(|p| statement.get(p));
        let after = &statement[i + 1..];
        SESSION_FUNCTIONS
            .iter()
            .any(|f| token.names(f) && !(*f == "set_config" && sets_local_config(after)))
            || SQL_TEXT_FUNCTIONS.iter().any(|f| token.names(f))
            || (token.names("ts_rewrite") && call_arguments(after).is_none_or(|a| a.len() != 3))
            // `pg_temp.t` creates, or finds, an object in the session's temporary schema.
            || (token.names_temp_schema() && matches!(after.first(), Some(Token::Other(b'.'))))
            || (token.is("CREATE") && creates_temporary(after))
            // SELECT … INTO TEMP t; `INSERT INTO temp` is a table named temp.
            || (token.is("INTO")
                && !before.is_some_and(|t| t.is("INSERT") || t.is("MERGE"))
                && temporary(after))
            || (declares && token.is("WITH") && after.first().is_some_and(|t| t.is("HOLD")))
            || (token.is("UPDATE") && updates_pg_settings(after))
            || (token.is("SET") && sets_temporary_search_path(after))
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

/// Whether the call after a `set_config` surely sets a setting for the
/// transaction only, and one the guard has no reason to refuse:
/// `(<name>, <value>, true)` with the name a string the guard reads, not
/// client_encoding (as `SET LOCAL`), and for search_path a value the guard
/// reads that does not name pg_temp.
fn sets_local_config(after_name: &[Token<'_>]) -> bool {
    let Some(arguments) = call_arguments(after_name) else {
        return false;
    };
    let [[Token::Literal(Some(name))], value, [Token::Word(local)]] = arguments.as_slice() else {
        return false;
    };
    if !local.eq_ignore_ascii_case("true") || name.eq_ignore_ascii_case("client_encoding") {
        return false;
    }
    // set_config splits the value into names and folds their case, which in
    // a single-byte server encoding may turn a non-ASCII letter into ASCII.
    !name.eq_ignore_ascii_case("search_path")
        || matches!(value, [value @ Token::Literal(Some(path))] if path.is_ascii() && !names_pg_temp(value))
}

/// The arguments of the call whose `(` starts `after_name`, split at its
/// top-level commas; `None` when it is not a call or does not end.
fn call_arguments<'t, 'a>(after_name: &'t [Token<'a>]) -> Option<Vec<&'t [Token<'a>]>> {
    let [Token::Other(b'('), rest @ ..] = after_name else {
        return None;
    };
    let mut arguments = Vec::new();
    let (mut depth, mut start) = (0_usize, 0);
    for (i, token) in rest.iter().enumerate() {
        match token {
            Token::Other(b'(' | b'[') => depth += 1,
            Token::Other(b')' | b']') if depth > 0 => depth -= 1,
            Token::Other(b')') => {
                arguments.push(&rest[start..i]);
                return Some(arguments);
            }
            Token::Other(b',') if depth == 0 => {
                arguments.push(&rest[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    None
}

/// `[ONLY] [(] [catalog.][schema.]pg_settings` after UPDATE: its rule calls
/// `set_config(name, setting, false)`.
fn updates_pg_settings(after_update: &[Token<'_>]) -> bool {
    let mut target = after_update;
    if target.first().is_some_and(|t| t.is("ONLY")) {
        target = &target[1..];
    }
    while let [Token::Other(b'('), rest @ ..] = target {
        target = rest;
    }
    loop {
        match target {
            [qualifier, Token::Other(b'.'), rest @ ..] if qualifier.identifier().is_some() => {
                target = rest;
            }
            [name, ..] => return name.names("pg_settings"),
            [] => return false,
        }
    }
}

/// `[LOCAL | SESSION] search_path {= | TO} value, …` after SET (a statement,
/// or a function's SET clause) where a value names the temporary schema or
/// is a string the guard cannot read: an unqualified CREATE then creates a
/// temporary object, which outlives the transaction.
fn sets_temporary_search_path(after_set: &[Token<'_>]) -> bool {
    let after_set = match after_set {
        [scope, rest @ ..] if scope.is("LOCAL") || scope.is("SESSION") => rest,
        _ => after_set,
    };
    let [name, assign, values @ ..] = after_set else {
        return false;
    };
    let mut values = values;
    if !name.names("search_path") || !(assign.is("TO") || *assign == Token::Other(b'=')) {
        return false;
    }
    while let [value, rest @ ..] = values {
        if value.names_temp_schema() || names_pg_temp(value) {
            return true;
        }
        values = match rest {
            [Token::Other(b','), rest @ ..] => rest,
            _ => return false,
        };
    }
    false
}

/// A string that may name pg_temp: one the guard cannot read, or whose
/// value mentions it in any case (erring towards refusing).
fn names_pg_temp(value: &Token<'_>) -> bool {
    match value {
        Token::Literal(None) => true,
        Token::Literal(Some(value)) => value.to_ascii_lowercase().contains("pg_temp"),
        _ => false,
    }
}

#[cfg(test)]
mod tests;
